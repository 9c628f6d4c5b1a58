"""Which code made a run, and whether a reader can check it.

A commit alone does not say what ran: the tree may have held uncommitted changes, or (on a GPU node that
received a copy of the tree) the commit may be one the sender named. So every run records a **code hash** —
sha256 over the files that decide what a run measures (`CODE_PATTERNS`: the package, the notebooks,
pyproject.toml), each by path and content — and, when those files differ from the commit, the diff itself
(`<run>/git.diff`, with its sha256 in run.json). Later, anywhere the commit is known to git, `status`
recomputes the commit's code hash and says whether the run's code was that commit, that commit plus the
recorded diff, or something nobody can reconstruct.

Statuses (`status(record, run_dir)`), best first:

- ``verified``     the run's code hash equals its commit's: the commit is exactly the code that ran.
- ``diff``         the code differed from the commit and the diff is recorded beside the run (its hash checks).
- ``clean``        a run from before code hashes whose git saw a clean tree at that commit.
- ``unverified``   the commit came from ``KVLAB_GIT_COMMIT`` (a sent tree) and no code hash was recorded.
- ``dirty``        git saw uncommitted changes and nothing recorded them: the code cannot be reconstructed.
- ``mismatch``     a code hash was recorded and differs from the commit's, with no diff to explain it.
- ``unknown``      the commit is not in this repository (cannot be checked here).
- ``no commit``    the run recorded no commit.

`PUBLISHABLE` are the statuses under which a reader can get the code that ran.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from . import claims, paths

__all__ = ["CODE_PATTERNS", "PUBLISHABLE", "git_state", "code_paths", "tree_hash", "commit_hash", "code_diff",
           "rebuilt_hash", "status", "drawing", "short", "add_arguments", "run_args"]

# fnmatch patterns ('*' also crosses '/'): what decides a run's measurement. Tests, docs and data do not.
CODE_PATTERNS = ("kvlab/*.py", "notebooks/*.ipynb", "pyproject.toml")
PUBLISHABLE = ("verified", "diff", "clean")


def _is_code(path: str) -> bool:
    return any(fnmatch.fnmatch(path, p) for p in CODE_PATTERNS)


def _root(root) -> Path:
    return Path(root) if root is not None else paths.repo_root()


def code_paths(root: str | os.PathLike | None = None) -> list[str]:
    """The code files of the working tree at ``root`` (default: the repository), relative, sorted: what git
    sees there (tracked, or untracked and not ignored — so JupyterLab's .ipynb_checkpoints and other ignored
    files do not count), or, outside a git repository, every matching file not under a hidden folder."""
    root = _root(root)
    listed = _git(root, "ls-files", "-z", "-co", "--exclude-standard", "--", "kvlab", "notebooks", "pyproject.toml") \
        if (root / ".git").exists() else None
    if listed is not None and listed.returncode == 0:
        out = [p for p in listed.stdout.decode().split("\0") if p and (root / p).is_file()]
    else:
        out = []
        for top in ("kvlab", "notebooks"):
            base = root / top
            if base.is_dir():
                out += [p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file()]
        if (root / "pyproject.toml").is_file():
            out.append("pyproject.toml")
    return sorted(p for p in out if _is_code(p) and "__pycache__" not in p
                  and not any(part.startswith(".") for part in p.split("/")))


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).hexdigest().encode() + b"\n")
    return h.hexdigest()


def tree_hash(root: str | os.PathLike | None = None) -> str:
    """The code hash of the files on disk under ``root``."""
    root = _root(root)
    return _digest({p: (root / p).read_bytes() for p in code_paths(root)})


# the bytes on disk, not what a clean filter would commit: the notebooks' nbstripout filter (make installs it) strips
# outputs, and a diff through it would not rebuild the files that ran (rebuilt_hash); it also costs a Python start
# per notebook
_RAW = ("-c", "filter.nbstripout.clean=cat", "-c", "filter.nbstripout.smudge=cat", "-c",
        "filter.nbstripout.required=false", "-c", "diff.ipynb.textconv=cat")


def _git(root: Path, *args: str, data: bytes | None = None) -> subprocess.CompletedProcess | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        return subprocess.run([git, "-C", str(root), *_RAW, *args], input=data, capture_output=True, timeout=120,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _commit_files(commit: str, root: Path) -> dict[str, bytes] | None:
    """{path: bytes} of ``commit``'s code files, or None where git or the commit is not available here."""
    if not commit:
        return None
    listing = _git(root, "ls-tree", "-r", "-z", "--name-only", commit)
    if listing is None or listing.returncode != 0:
        return None
    paths = [p for p in listing.stdout.decode().split("\0")
             if p and _is_code(p) and not any(part.startswith(".") for part in p.split("/"))]
    if not paths:
        return {}
    # one `git cat-file --batch` for every blob: a `git show` per file would take seconds
    batch = _git(root, "cat-file", "--batch", data="".join(f"{commit}:{p}\n" for p in paths).encode())
    if batch is None or batch.returncode != 0:
        return None
    out, files, i = batch.stdout, {}, 0
    for p in paths:
        nl = out.index(b"\n", i)
        header = out[i:nl].split()
        if len(header) < 3 or header[1] != b"blob":
            return None
        size = int(header[2])
        files[p] = out[nl + 1:nl + 1 + size]
        i = nl + 1 + size + 1
    return files


def commit_hash(commit: str, root: str | os.PathLike | None = None) -> str | None:
    """The code hash of ``commit``'s tree, or None where git or the commit is not available here."""
    files = _commit_files(commit, _root(root))
    return None if files is None else _digest(files)


def code_diff(root: str | os.PathLike | None = None, base: str = "HEAD") -> str:
    """What the code files on disk change against commit ``base``, as a patch (`git apply` takes it): tracked
    files by `git diff <base>`, untracked code files as new files. Empty when they match or git is missing."""
    root = _root(root)
    parts = []
    tracked = _git(root, "diff", "--binary", base, "--", *CODE_PATTERNS)
    if tracked is not None and tracked.returncode == 0:
        parts.append(tracked.stdout.decode(errors="replace"))
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", "kvlab", "notebooks")
    if untracked is not None and untracked.returncode == 0:
        for p in sorted(x for x in untracked.stdout.decode().split("\0") if x and _is_code(x)):
            new = _git(root, "diff", "--binary", "--no-index", "--", "/dev/null", p)
            if new is not None:
                parts.append(new.stdout.decode(errors="replace"))
    return "".join(parts)


def read_diff(path: str | os.PathLike) -> bytes | None:
    """The bytes of a run's recorded diff: the file itself, or — a large one kept compressed in git — the same name
    with .gz, decompressed (its sha256 in run.json is of the patch, so either checks the same). None if neither."""
    import gzip

    path = Path(path)
    if path.is_file():
        return path.read_bytes()
    packed = path.with_name(path.name + ".gz")
    return gzip.decompress(packed.read_bytes()) if packed.is_file() else None


def rebuilt_hash(commit: str, diff: str | os.PathLike, root: str | os.PathLike | None = None) -> str | None:
    """The code hash of ``commit``'s code files with the patch ``diff`` applied, in a scratch folder: whether a
    recorded diff really rebuilds the code that ran. None where git, the commit or the patch fail."""
    import tempfile

    root = _root(root)
    files = _commit_files(commit, root)
    if files is None:
        return None
    with tempfile.TemporaryDirectory(prefix="kvlab-rebuild-") as tmp:
        for path, data in files.items():
            target = Path(tmp) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        if Path(diff).stat().st_size:
            # the scratch folder is no repository, and git must not find one above it (a TMPDIR inside a
            # checkout): then `git apply` patches the files in the folder
            env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(tmp).parent)}
            applied = subprocess.run(["git", "apply", "--whitespace=nowarn", str(Path(diff).resolve())], cwd=tmp,
                                     capture_output=True, timeout=120, check=False, env=env)
            if applied.returncode != 0:
                return None
        return tree_hash(tmp)


_SHA = re.compile(r"^[0-9a-f]{7,40}$")


def status(record: dict, run_dir: str | os.PathLike | None = None,
           root: str | os.PathLike | None = None) -> tuple[str, str]:
    """(status, one line of detail) of a run's provenance; see the module's docstring for the statuses."""
    git = record.get("git") or {}
    commit = git.get("commit")
    if not commit:
        return "no commit", "run.json names no commit"
    if not isinstance(commit, str) or not _SHA.match(commit):
        return "unknown", f"run.json's commit {str(commit)[:20]!r} is not a commit id"
    recorded = git.get("code_sha256")
    if recorded:
        expected = commit_hash(commit, root)
        if expected is None:
            return "unknown", f"commit {commit[:10]} is not in this repository"
        if recorded == expected:
            return "verified", f"code hash matches commit {commit[:10]}"
        diff_name = git.get("diff_file")
        if diff_name and run_dir is not None and "/" not in diff_name and ".." not in diff_name:
            patch = read_diff(Path(run_dir) / diff_name)
            if patch is not None and hashlib.sha256(patch).hexdigest() == git.get("diff_sha256"):
                import tempfile

                with tempfile.NamedTemporaryFile(suffix=".diff") as f:
                    f.write(patch)
                    f.flush()
                    if rebuilt_hash(commit, f.name, root) == recorded:
                        return "diff", f"commit {commit[:10]} + {diff_name} rebuilds the code that ran"
        return "mismatch", f"code hash differs from commit {commit[:10]} and no recorded diff rebuilds it"
    if git.get("commit_source") == "KVLAB_GIT_COMMIT":
        return "unverified", f"commit {commit[:10]} sent by KVLAB_GIT_COMMIT; no code hash to check it against"
    if git.get("dirty") is False:
        return "clean", f"git saw a clean tree at {commit[:10]}"
    if git.get("dirty"):
        paths = [p for p in (git.get("dirty_paths") or []) if _is_code(p)]
        return "dirty", (f"commit {commit[:10]} with uncommitted changes ({len(paths)} code paths listed"
                         f"{', list cut at 20' if len(git.get('dirty_paths') or []) >= 20 else ''}), no diff recorded")
    return "unverified", f"commit {commit[:10]}; whether the tree was clean was not recorded"


def git_state(root: str | os.PathLike | None = None) -> dict:
    """``{"commit": sha or None, "dirty": bool or None, "dirty_paths": [...]}`` of the repository
    holding ``root`` (default ``paths.repo_root()``).

    ``commit`` is None without git, outside a repository or before its first commit; ``dirty``
    is None without git or outside a repository. Changes under the data and figures roots are
    not dirt: they are what runs write, and counting them would mark every second run dirty.
    ``dirty_paths`` lists every changed path. ``code_sha256`` is this module's hash of the code
    files on disk, which `kvlab provenance` later checks against the commit's.
    """
    state = _git_state(root)
    try:
        code = tree_hash(root if root is not None else None)
    except OSError:
        code = None
    # A copy of the tree sent to a GPU node may have no usable .git, or a stale one (the node's copy kept
    # the .git of an older commit and sees the sent changes as dirt): only the sender can name the commit
    # the tree is, through KVLAB_GIT_COMMIT. It then wins, and what the local git saw is kept beside it.
    sent = os.environ.get("KVLAB_GIT_COMMIT", "").strip()
    if sent and state["commit"] != sent:
        local = {"commit": state["commit"], "dirty": state["dirty"], "dirty_paths": state["dirty_paths"]}
        state = {"commit": sent, "dirty": None, "dirty_paths": [], "commit_source": "KVLAB_GIT_COMMIT",
                 "local_git": local}
    state["code_sha256"] = code
    return state


def _git_state(root) -> dict:
    root = Path(root) if root is not None else paths.repo_root()
    unknown = {"commit": None, "dirty": None, "dirty_paths": []}
    git = shutil.which("git")
    if git is None or not root.is_dir():
        return unknown

    def call(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run([git, "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None

    top = call("rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0 or not top.stdout.strip():
        return unknown
    top_dir = Path(top.stdout.strip()).resolve()
    head = call("rev-parse", "--verify", "--quiet", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else None
    excludes = []
    for output in (paths.data_root(), paths.figures_root()):
        try:
            excludes.append(f":(top,exclude){output.resolve().relative_to(top_dir).as_posix()}")
        except ValueError:  # outside this repository: nothing of it can show up in git status
            pass
    status = call("status", "--porcelain", "--untracked-files=all", "--", ":(top)", *excludes)
    if status is None or status.returncode != 0:
        return {"commit": commit, "dirty": None, "dirty_paths": []}
    changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    return {"commit": commit, "dirty": bool(changed), "dirty_paths": changed}


def drawing() -> dict:
    """The code drawing a figure now: ``{"commit", "code_sha256", "code_matches_commit"}`` (the last None
    where it cannot be told). A figure's sidecar and footer carry it, beside the run whose data it shows."""
    git = git_state()
    commit, code = git.get("commit"), git.get("code_sha256")
    expected = commit_hash(commit) if commit else None
    return {"commit": commit, "code_sha256": code,
            "code_matches_commit": None if expected is None or code is None else code == expected}


def short(drawn: dict) -> str:
    """``abc1234`` (the code is that commit's), ``abc1234+changes`` (it is not), ``abc1234?`` (cannot tell),
    ``no commit``."""
    commit = drawn.get("commit")
    if not commit:
        return "no commit"
    tail = {True: "", False: "+changes"}.get(drawn.get("code_matches_commit"), "?")
    return commit[:7] + tail


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="*", help="run folders (default: every run under data/)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a run's code cannot be reconstructed (status not in "
                             + ", ".join(PUBLISHABLE) + ")")


def run_args(args) -> int:
    dirs = [Path(r) for r in args.runs] or sorted(p.parent for p in paths.data_root().glob("*/*/run.json"))
    bad = 0
    for d in dirs:
        f = d / "run.json"
        if not f.is_file():
            raise SystemExit(f"kvlab provenance: {d} has no run.json; give a run folder such as "
                             f"data/handoff/<run_id>")
        record = paths.read_json(f)
        st, detail = status(record, d)
        bad += st not in PUBLISHABLE
        ran = record.get("status") if isinstance(record, dict) else "unreadable"
        if ran == "running":  # its claim says whether the process that writes it is still there
            c = claims.held(d)
            ran = ("running" if claims.alive(c) else "killed: its process is gone") if c else "running, or killed"
        print(f"{st:<11} {d}  {detail}" + ("" if ran == "finished" else f" (the run itself: {ran}, not a result)"))
    if args.check and bad:
        print(f"{bad} of {len(dirs)} runs cannot be reconstructed")
        return 1
    return 0
