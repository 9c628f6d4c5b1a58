"""Mutation check of kvlab.goals (issue 12): flip each comparison of the evaluator, one at a time, and run the
tests that judge goals; every mutant should make them fail. Run from the repository root:
    python tools/mutate_goals.py
It edits kvlab/goals.py in place while it runs and puts it back at the end (also on Ctrl-C)."""
import pathlib
import subprocess
import sys

root = pathlib.Path(__file__).resolve().parent.parent
src = root / "kvlab" / "goals.py"
orig = src.read_text()
muts = [
 ('return ("met" if b <= t else "missed" if a > t else "not resolved"), "interval"', 'return ("met" if b >= t else "missed" if a > t else "not resolved"), "interval"'),
 ('return ("met" if b <= t else "missed" if a > t else "not resolved"), "interval"', 'return ("met" if b <= t else "missed" if a < t else "not resolved"), "interval"'),
 ('return ("met" if a >= t else "missed" if b < t else "not resolved"), "interval"', 'return ("met" if a <= t else "missed" if b < t else "not resolved"), "interval"'),
 ('return ("met" if a >= t else "missed" if b < t else "not resolved"), "interval"', 'return ("met" if a >= t else "missed" if b > t else "not resolved"), "interval"'),
 ('ok = v <= t if op == "<=" else v >= t', 'ok = v >= t if op == "<=" else v >= t'),
 ('ok = v <= t if op == "<=" else v >= t', 'ok = v <= t if op == "<=" else v <= t'),
 ('a, b = min(a, b), max(a, b)', 'a, b = a, b'),
 ('if op == "<=":\n            return', 'if op != "<=":\n            return'),
 ('    return r.context == t.context.max()', '    return r.context != t.context.max()'),
 ('    return r.context >= 4096 or _peer(r)', '    return r.context < 4096 or _peer(r)'),
 ('    return r.context == t.context.min() and r.context <= HOST_BOUND_CONTEXT', '    return r.context == t.context.min() and r.context > HOST_BOUND_CONTEXT'),
 ('    return _peer(r) and r.context == t.context.max() and r.context >= PEER_GOAL_CONTEXT', '    return _peer(r) and r.context == t.context.max() and r.context < PEER_GOAL_CONTEXT'),
 ('            if rule == "no value":', '            if rule != "no value":'),
 ('    return {"met": True, "missed": False}.get(verdict)', '    return {"met": True, "missed": True}.get(verdict)'),
 ('        return r.method == method and str(r.destination).startswith(dest_prefix)', '        return r.method == method'),
 ('    return str(r.destination).startswith("peer-")', '    return True'),
 ('    if math.isnan(t) or (math.isnan(v) and (math.isnan(a) or math.isnan(b))):', '    if math.isnan(t):'),
 ('    if not (math.isnan(a) or math.isnan(b)):', '    if False:'),
 ('def judge(value, lo, hi, op: str, threshold) -> tuple[str, str]:', 'def judge(value, lo, hi, op: str, threshold) -> tuple[str, str]:\n    return "met", "interval"'),
 ('    if lo is not None and hi is not None and (math.isnan(a) or math.isnan(b)):', '    if False:'),
 ('    if (lo is None) != (hi is None):', '    if (lo is None) == (hi is None):'),
 ('r.mode == "bulk" and r.context == 32768 and bool(r.same_gpu)\n', 'r.mode == "bulk" and r.context != 32768 and bool(r.same_gpu)\n'),
 ('r.mode == "bulk" and r.context == 32768 and bool(r.same_gpu)\n', 'r.mode == "bulk" and r.context == 32768\n'),
 ('            and getattr(r, "backend", "ipc") == "ipc")', '            and getattr(r, "backend", "ipc") != "ipc")'),
 ('r.context == 32768 and not bool(r.same_gpu)', 'r.context == 32768 and bool(r.same_gpu)'),
 ('            and getattr(r, "backend", None) in ("ipc", "nccl"))', '            and getattr(r, "backend", None) not in ("ipc", "nccl"))'),
 ('    return getattr(r, "mode", None) == "layerwise" and 4096 <= r.context <= 32768', '    return getattr(r, "mode", None) == "layerwise" and 4096 > r.context'),
 ('    return getattr(r, "mode", None) == "layerwise" and 4096 <= r.context <= 32768', '    return getattr(r, "mode", None) == "layerwise" and 4096 <= r.context'),
 ('    return bool(getattr(r, "first_row", False))', '    return True'),
 ('            lo = getattr(r, g.lo, None) if g.lo else None\n            hi = getattr(r, g.hi, None) if g.hi else None',
  '            lo = getattr(r, g.lo, nan) if g.lo else nan\n            hi = getattr(r, g.hi, nan) if g.hi else nan'),
]
killed = 0
try:
    for i, (a, b) in enumerate(muts):
        if a not in orig:
            print(i, "NOT FOUND", a[:60]); continue
        src.write_text(orig.replace(a, b, 1))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            "tests/test_goals.py", "tests/test_handoff.py", "tests/test_paged.py", "tests/test_analyse.py"],
                           cwd=root, capture_output=True, text=True)
        dead = r.returncode != 0
        killed += dead
        print(i, "killed" if dead else "SURVIVED", "|", b.strip()[:90], flush=True)
finally:
    src.write_text(orig)
print(f"{killed}/{len(muts)} killed")

