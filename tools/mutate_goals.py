"""Mutation check of kvlab.goals (issues 12 and 25): flip each comparison of the evaluator, and bend each kind of
goal (a threshold, a metric, a yardstick, an interval column; in goals.py alone, and in goals.py and its ledger
together), one at a time, and run the tests that judge goals; every mutant should make them fail. The unmutated
suite runs first: where it already fails, every mutant would count as killed, so the check stops. Run from the
repository root:
    python tools/mutate_goals.py
It edits kvlab/goals.py (and kvlab/goals_ledger.json) in place while it runs and puts them back at the end (also
on Ctrl-C)."""
import json
import pathlib
import subprocess
import sys

root = pathlib.Path(__file__).resolve().parent.parent
src = root / "kvlab" / "goals.py"
book = root / "kvlab" / "goals_ledger.json"
orig = src.read_text()
orig_book = book.read_text()
TESTS = ["tests/test_goals.py", "tests/test_goals_ledger.py", "tests/test_handoff.py", "tests/test_paged.py",
         "tests/test_analyse.py", "tests/test_disagg_study.py", "tests/test_tp_reshard_study.py",
         "tests/test_wire_study.py", "tests/test_contention_study.py"]
# a goal bent in goals.py: (what it says today, what the mutant says, the goal id and ledger field to bend with it)
BENT = [
 ('"ipc and nccl bulk send ≥ 90 % of the peer copy of the same bytes, two GPUs",\n         "pct_of_ceiling", ">=", 90.0,',
  '"ipc and nccl bulk send ≥ 90 % of the peer copy of the same bytes, two GPUs",\n         "pct_of_ceiling", ">=", 89.0,',
  "disagg.peer_send", "threshold", 89.0),
 ('"pct_of_best_peer", ">=", 90.0, lo="pct_best_lo"', '"pct_of_best_peer", ">=", 64.0, lo="pct_best_lo"',
  "disagg.peer_send_link", "threshold", 64.0),
 ('"pct_of_same_tp", ">=", 90.0, lo="pct_lo"', '"pct_of_same_tp", ">=", 80.0, lo="pct_lo"',
  "tp_reshard.hnd_fused", "threshold", 80.0),
 ('"pred_err_abs_pct", "<=", 10.0,', '"pred_err_abs_pct", "<=", 900.0,', "tp_reshard.calculator", "threshold", 900.0),
 ('"ms_median", "<=", 18.7, lo="ms_lo", hi="ms_hi", unit=" ms", digits=2,\n         applies=_wire("dequantize-scatter"',
  '"ms_median", "<=", 19.1, lo="ms_lo", hi="ms_hi", unit=" ms", digits=2,\n         applies=_wire("dequantize-scatter"',
  "wire.fp8_h2d", "threshold", 19.1),
 ('"abs_error_pct", "<=", 10.0,', '"abs_error_pct", ">=", 10.0,', "contention.sim_each", "op", ">="),
 ('"pct_of_best_peer", ">=", 90.0, lo="pct_best_lo", hi="pct_best_hi"', '"pct_of_ceiling", ">=", 90.0, lo="pct_lo", hi="pct_hi"',
  "disagg.peer_send_link", "metric", "pct_of_ceiling"),
 ('"pct_of_ceiling", ">=", 90.0, lo="pct_lo", hi="pct_hi", unit=" %", digits=1,\n         applies=_disagg_paged_32k_one_gpu',
  '"pct_of_ceiling", ">=", 82.0, lo="pct_lo", hi="pct_hi", unit=" %", digits=1,\n         applies=_disagg_paged_32k_one_gpu',
  "disagg.ipc_paged", "threshold", 82.0),
 ('"layerwise_extra_ms", "<=",\n         "copy_ms",', '"layerwise_extra_ms", "<=",\n         "copy_tensor_ms",',
  "handoff.never_worse_than_bulk", "threshold", "copy_tensor_ms"),
 ('Goal("handoff.bulk_link", "handoff", "bulk ≥ 95 % of the link ceiling", "copy_pct_ceiling", ">=", 95.0,',
  'Goal("handoff.bulk_link", "handoff", "bulk ≥ 95 % of the link ceiling", "copy_pct_ref", ">=", 95.0,',
  "handoff.bulk_link", "metric", "copy_pct_ref"),
 ('"exposed_ms", "<=",\n         "copy_layer_ms", lo="exposed_ci_lo_ms"', '"exposed_ms", "<=",\n         "copy_ms", lo="exposed_ci_lo_ms"',
  "handoff.exposed_one_layer", "threshold", "copy_ms"),
 ('"faults.deadline", "faults", "no fault waits longer than its deadline + 1 s", "over_deadline_ms", "<=", 1000.0,',
  '"faults.deadline", "faults", "no fault waits longer than its deadline + 1 s", "over_deadline_ms", "<=", 2000.0,',
  "faults.deadline", "threshold", 2000.0),
 ('"tracing adds ≤ 5 % to prefill", "tracing_pct", "<=", 5.0,', '"tracing adds ≤ 5 % to prefill", "tracing_pct", ">=", 5.0,',
  "overlap.tracing", "op", ">="),
 ('lo="pct_lo", hi="pct_hi", unit=" %", digits=1, applies=_paged("triton", "same-gpu")',
  'lo="pct_hi", hi="pct_hi", unit=" %", digits=1, applies=_paged("triton", "same-gpu")',
  "paged.triton_same_gpu", "lo", "pct_hi"),
]
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


def suite() -> bool:
    """Do the goal tests pass (on the files as they are now)?"""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS], cwd=root,
                       capture_output=True, text=True)
    return r.returncode == 0


def ledger_with(gid: str, field: str, value) -> str:
    entries = json.loads(orig_book)
    entries[gid][field] = value
    return json.dumps(entries, indent=1, ensure_ascii=False) + "\n"


# (label, goals.py text, ledger text) of every mutant
cases = [(b.strip()[:90], orig.replace(a, b, 1), orig_book) for a, b in muts if a in orig]
missing = [a[:60] for a, b in muts if a not in orig]
for a, b, gid, field, value in BENT:
    if a not in orig:
        missing.append(a[:60])
        continue
    cases.append((f"{gid}.{field} -> {value!r} in goals.py", orig.replace(a, b, 1), orig_book))
    cases.append((f"{gid}.{field} -> {value!r} in goals.py and its ledger", orig.replace(a, b, 1),
                  ledger_with(gid, field, value)))
if missing:
    sys.exit("mutants whose text is no longer in goals.py (update this list): " + "; ".join(missing))
print("baseline (no mutant):", end=" ", flush=True)
if not suite():
    sys.exit("FAILS — the goal tests fail without a mutant, so no mutant could be told apart; fix them first")
print("passes")
killed = 0
try:
    for i, (label, code, ledger) in enumerate(cases):
        src.write_text(code)
        book.write_text(ledger)
        dead = not suite()
        killed += dead
        print(i, "killed" if dead else "SURVIVED", "|", label, flush=True)
finally:
    src.write_text(orig)
    book.write_text(orig_book)
print(f"{killed}/{len(cases)} killed")

