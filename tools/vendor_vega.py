"""Vendor the chart library kvlab's interactive pages load (Vega, Vega-Lite and vega-embed) into figures/vendor/,
once, from the npm registry: `python tools/vendor_vega.py` (needs npm). The versions are the ones the installed
Altair writes specs for (altair.VEGA_VERSION / VEGALITE_VERSION / VEGAEMBED_VERSION, newest release of that line);
VERSIONS.json records each file's package, version and sha256, and the packages' licences are copied beside.
Pages link these files by a relative path (kvlab.pages), so they open from disk with no network."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import altair

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "figures" / "vendor"
PACKAGES = {"vega": (altair.VEGA_VERSION, "build/vega.min.js"),
            "vega-lite": (altair.VEGALITE_VERSION, "build/vega-lite.min.js"),
            "vega-embed": (altair.VEGAEMBED_VERSION, "build/vega-embed.min.js")}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    record = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (version, member) in PACKAGES.items():
            spec = f"{name}@{version.lstrip('v')}"
            done = subprocess.run(["npm", "pack", "--silent", spec], cwd=tmp, capture_output=True, text=True)
            if done.returncode:
                print(f"npm pack {spec} failed: {done.stderr.strip()}", file=sys.stderr)
                return 1
            tgz = Path(tmp) / done.stdout.strip().splitlines()[-1]
            with tarfile.open(tgz) as t:
                data = t.extractfile(f"package/{member}").read()
                meta = json.loads(t.extractfile("package/package.json").read())
                licence = t.extractfile("package/LICENSE").read()
            target = OUT / Path(member).name
            target.write_bytes(data)
            (OUT / f"LICENSE.{name}").write_bytes(licence)
            record[target.name] = {"package": name, "version": meta["version"], "license": meta.get("license"),
                                   "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (OUT / "VERSIONS.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
