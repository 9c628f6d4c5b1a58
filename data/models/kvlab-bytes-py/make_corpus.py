"""The text kvlab-bytes-py was trained and is judged on: the top-level modules of one Python standard library (the
*.py files directly in its Lib folder, sorted by name), each preceded by a line naming it. Every tenth file (by
sorted position 9, 19, …) is held out; the rest is the training text. Run once, on the machine that trained the
model: `python make_corpus.py [STDLIB]` writes train.txt.gz and heldout.txt.gz beside this script (gzip with no
name or time inside, so the bytes depend only on the text) and refuses to overwrite them. The committed files
are the corpus: another Python's standard library would give another text, so nothing regenerates them."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent


def corpus(stdlib: Path) -> tuple[bytes, bytes, list[str], list[str]]:
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise SystemExit(f"make_corpus: no *.py files in {stdlib}")
    train, held, train_names, held_names = [], [], [], []
    for i, p in enumerate(files):
        text = f"# ---- {p.name} ----\n".encode() + p.read_bytes()
        (held if i % 10 == 9 else train).append(text)
        (held_names if i % 10 == 9 else train_names).append(p.name)
    return b"".join(train), b"".join(held), train_names, held_names


def main() -> int:
    stdlib = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(sysconfig.get_paths()["stdlib"])
    train, held, train_names, held_names = corpus(stdlib)
    for name, data in (("train.txt.gz", train), ("heldout.txt.gz", held)):
        with open(HERE / name, "xb") as f:  # never overwrite the corpus a model was trained on
            f.write(gzip.compress(data, compresslevel=9, mtime=0))
    meta = {"source": str(stdlib), "python": sys.version.split()[0], "train_files": train_names,
            "heldout_files": held_names, "train_bytes": len(train), "heldout_bytes": len(held),
            "train_sha256": hashlib.sha256(train).hexdigest(), "heldout_sha256": hashlib.sha256(held).hexdigest()}
    with open(HERE / "corpus.json", "x", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
    print(f"train {len(train):,} bytes ({len(train_names)} files), held out {len(held):,} bytes ({len(held_names)} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
