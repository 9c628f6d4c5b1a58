"""32k Qwen2.5-7B cache to pageable host: the handoff's timed bulk copy vs plain copies of the same bytes,
interleaved in one process (A B C D, 9 rounds)."""
import statistics, time, torch
from kvlab.kvcache import KVBuffer, KVLayout
from kvlab.transfer import Destination, Transport
from kvlab.handoff import _time_copy

dev = torch.device("cuda")
layout = KVLayout(28, 1, 4, 32768, 128, torch.bfloat16)
src = KVBuffer(layout, device=dev)
src.data.view(torch.int16).random_(0, 2**15)
t = Transport(layout, Destination.parse("pageable", dev), dev, granularity="buffer")
t.poison()
other = torch.empty_like(src.data, device="cpu"); other.fill_(1)
n = src.data.numel() * 2

def ev(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record(); fn(); b.record(); b.synchronize()
    return a.elapsed_time(b)

def host(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); return (time.perf_counter() - t0) * 1e3

variants = {
    "A handoff._time_copy (transport send, held stream)": lambda: _time_copy(t, src, dev),
    "B plain copy_ into the transport's buffer (events)": lambda: ev(lambda: t.buffer.data.copy_(src.data)),
    "C plain copy_ into another touched buffer (events)": lambda: ev(lambda: other.copy_(src.data)),
    "D plain copy_ into the transport's buffer (host clock)": lambda: host(lambda: t.buffer.data.copy_(src.data)),
}
res = {k: [] for k in variants}
for k, f in variants.items():
    f()
for r in range(9):
    ks = list(variants)
    ks = ks[r % 4:] + ks[:r % 4]
    for k in ks:
        res[k].append(variants[k]())
for k, v in res.items():
    m = statistics.median(v)
    print(f"PAB {k:55s} median {m:7.1f} ms {n/m/1e6:6.2f} GB/s (min {min(v):.1f} max {max(v):.1f})", flush=True)
print("PAB src bytes", n, "buffer ptr aligned 4K:", t.buffer.data.data_ptr() % 4096, other.data_ptr() % 4096)
