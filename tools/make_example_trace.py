"""Write examples/trace_tiny_cpu.json.gz: a real torch.profiler (Kineto) trace of one prefill of kvlab's tiny
model, with kvlab's per-layer ranges (random weights, 64 tokens) on the CPU, small enough to ship. README's `kvlab trace load` example and
tests/test_examples.py read it. Rerun this script to remake it (the timings inside will differ, the shape not).
"""

from pathlib import Path

import torch

from kvlab import kvcache, models, steps, tracefmt
from kvlab.hooks import LayerHooks

root = Path(__file__).resolve().parents[1]
lm = models.build("kvlab-tiny", device="cpu", dtype=torch.float32)
layout = kvcache.layout_for(lm, 64)
src = kvcache.KVBuffer(layout, device=torch.device("cpu"))
ids = steps.make_prompt(lm.config.vocab_size, 64, torch.device("cpu"), seed=0)
hooks = LayerHooks(lm, lambda i: None, ranges=True)  # kvlab/layer{i} ranges split the timeline by layer


def run():
    with hooks:
        steps.prefill(lm, ids, src, hooks)


events, path = tracefmt.capture(run, device="cpu",
                                out_dir=root / "examples", name="trace_tiny_cpu")
print(f"{path} ({path.stat().st_size / 1024:.0f} KiB): {len(events)} events")
