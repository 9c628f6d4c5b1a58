"""Does an armed send stall on the first prefill of a model (CUDA lazy loading)? argv[1]: 'nowarm' or 'warm'."""
import os, sys, time
import torch
from kvlab import models, trace, handoff, transfer

mode = sys.argv[1]
init = transfer.LayerwiseSend.__init__
def short(self, *a, **k):
    init(self, *a, **k)
    self.watchdog_s = 8.0
transfer.LayerwiseSend.__init__ = short
if mode in ("nowarm", "syncdebug"):
    handoff.warm_prefill = lambda *a, **k: None
model = models.build("kvlab-tiny", device="cuda", dtype=torch.bfloat16)
if mode == "syncdebug":
    import warnings, traceback
    def show(message, category, filename, lineno, file=None, line=None):
        print("SYNCWARN", message, flush=True); traceback.print_stack(limit=12)
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode(1)
t0 = time.time()
try:
    et = trace.event_handoff(model, 64, "pinned", rounds=3, warmup=1, device="cuda")
    res = f"ok overhead={et.overhead.overhead_pct.iloc[0]:.2f}%"
except Exception as e:
    res = f"{type(e).__name__}: {str(e)[:160]}"
print(f"LAZY mode={mode} CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')} "
      f"{time.time() - t0:.1f}s {res}", flush=True)
