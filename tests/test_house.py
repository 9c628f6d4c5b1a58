"""The house rules (issue 25, item 3), checked rather than hoped for: no import cycle among kvlab's modules (imports
inside functions count), no private name of one module used by another, no module over 600 lines, kvlab's own
imports at the top of each file (inside a function only where a comment on the line names the heavy package it keeps
lazy: torch, jupyter_client, triton), and the import-linter contracts of pyproject.toml (faces → studies → library; no study imports another;
the library imports no study) kept."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "kvlab"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _imports(name: str, path: Path):
    """(target module, line, top-level?) of every kvlab import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(name, path).split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("kvlab"):
                continue
            for a in node.names:
                full = f"{mod}.{a.name}"
                yield (full if full in MODULES else mod), node.lineno, id(node) in top, a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvlab"):
                    yield a.name, node.lineno, id(node) in top, None


def test_no_import_cycle_among_kvlabs_modules():
    graph = defaultdict(set)
    for name, path in MODULES.items():
        for target, _, _, _ in _imports(name, path):
            if target != name and target in MODULES:
                graph[name].add(target)
    # Tarjan's strongly connected components: any of more than one module is a cycle
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(MODULES):
        if v not in index:
            visit(v)
    assert found == [], f"import cycles: {found}"


def test_no_private_name_of_one_module_is_used_by_another():
    used = []
    for name, path in MODULES.items():
        for target, line, _, imported in _imports(name, path):
            if imported and imported.startswith("_") and not imported.startswith("__") and target != name:
                used.append(f"{path.relative_to(REPO)}:{line} imports {imported} from {target}")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # the names this module gives kvlab modules it imports (os._exit and the like are not kvlab's business)
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.level or (n.module or "").startswith("kvlab")) for a in n.names}
        aliases |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                    if a.name.startswith("kvlab")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in aliases and node.value.id != "self"):
                used.append(f"{path.relative_to(REPO)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert used == [], "\n".join(used)


def test_no_module_over_600_lines():
    long = {str(p.relative_to(REPO)): n for p in MODULES.values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


LAZY = ("torch", "jupyter_client", "triton")  # what an import inside a function may keep lazy, said on its line


def test_kvlabs_own_imports_sit_at_the_top_of_each_file():
    inside = []
    for name, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for target, line, top, _ in _imports(name, path):
            comment = lines[line - 1].partition("#")[2]
            if not top and not any(pkg in comment for pkg in LAZY):
                inside.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert inside == [], ("kvlab imports inside functions (put them at the top of the file, or say on the line which "
                          f"of {', '.join(LAZY)} the import keeps lazy):\n" + "\n".join(inside))


def test_every_module_is_a_face_a_study_or_the_library_and_the_contracts_say_so():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    library = next(c for c in cfg if c["id"] == "library")["source_modules"]
    faces = next(c for c in cfg if c["id"] == "library")["forbidden_modules"]
    top = {n.split(".")[1] for n in MODULES if n.count(".") >= 1}
    classified = {m.split(".")[1] for m in [*library, *faces]}
    assert top - classified == set(), f"modules in no layer (add them to pyproject's contracts): {top - classified}"
    studies = next(c for c in cfg if c["id"] == "studies-apart")["modules"]
    assert sorted(m.split(".")[-1] for m in studies) == sorted(
        n.split(".")[2] for n in MODULES if n.startswith("kvlab.studies.") and n.count(".") == 2)


@pytest.mark.skipif(shutil.which("lint-imports") is None and not (Path(sys.executable).parent / "lint-imports").exists(),
                    reason="import-linter is not installed (make installs it with kvlab's dev extras)")
def test_the_import_linter_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
