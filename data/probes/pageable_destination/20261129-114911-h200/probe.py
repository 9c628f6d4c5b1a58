"""Device -> pageable host copies: does the destination's state (touched, fresh, huge pages) set the rate?"""
import ctypes, mmap, statistics, sys, time
import torch
dev = torch.device("cuda")
libc = ctypes.CDLL("libc.so.6")
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14

def t(src, dst):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); a.record(); dst.copy_(src); b.record(); b.synchronize()
    return a.elapsed_time(b)

def hp_buffer(n):
    buf = mmap.mmap(-1, n + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    off = (-base) % (2 << 20)
    libc.madvise(base + off, n, MADV_HUGEPAGE)
    tt = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=off)
    return buf, tt

for mib in (1024, 1792):
    n = mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    res = {}
    d = torch.empty(n, dtype=torch.uint8); d.fill_(1)
    t(src, d)
    res["same buffer, touched"] = [t(src, d) for _ in range(9)]
    del d
    res["fresh torch.empty each copy"] = []
    for _ in range(5):
        d = torch.empty(n, dtype=torch.uint8); res["fresh torch.empty each copy"].append(t(src, d)); del d
    keep = []
    buf, d = hp_buffer(n); d.fill_(1); t(src, d)
    res["madvise(HUGEPAGE), touched"] = [t(src, d) for _ in range(9)]
    del d; keep.append(buf)
    p = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    t(src, p)
    res["pinned"] = [t(src, p) for _ in range(9)]
    del p
    for k, v in res.items():
        m = statistics.median(v)
        print(f"PAGEABLE {mib} MiB  {k:30s} median {m:8.2f} ms  {n/m/1e6:6.2f} GB/s  (min {min(v):.2f} max {max(v):.2f}, n={len(v)})", flush=True)
    del src; torch.cuda.empty_cache()
print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
