"""Probe on 2 GPUs: can a Triton row kernel write into a pool another process shared by CUDA IPC (on the peer GPU)?
(a) push: kernel on cuda:0 stores into the IPC pointer on cuda:1; (b) pull: kernel on cuda:1 reads cuda:0, stores
into the IPC pointer; (c) staged: gather on cuda:0, one copy_ to cuda:1, scatter on cuda:1. Host-timed with syncs,
beside a contiguous peer copy of the same bytes, 32k Qwen shape (114,688 rows of 16 KiB), pools twice the rows."""
import statistics
import time
import traceback

import torch
import torch.multiprocessing as mp

from kvlab import kernels
from kvlab.paged_xport import enable_peer

ROWS, E = 114_688, 8192


def child(q, done):
    t = torch.full((2 * ROWS, E), -7.0, dtype=torch.bfloat16, device="cuda:1")
    q.put(t)
    done.wait()


def timed(fn, n=9):
    out = []
    for k in range(n + 2):
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        if k >= 2:
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out), min(out), max(out)


def main():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(q, done))
    p.start()
    dst = q.get()
    print("ipc tensor", dst.device, dst.shape, flush=True)
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    enable_peer(d0, d1)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2 * ROWS, E, dtype=torch.bfloat16, device=d0)
    sidx = torch.randperm(2 * ROWS, generator=g)[:ROWS].to(d0)
    didx_h = torch.randperm(2 * ROWS, generator=g)[:ROWS]
    nbytes = ROWS * E * 2
    a = torch.empty(nbytes, dtype=torch.uint8, device=d0)
    b = torch.empty(nbytes, dtype=torch.uint8, device=d1)
    ceil = timed(lambda: b.copy_(a))
    print(f"contiguous peer copy: {ceil[0]:.3f} ms ({nbytes / ceil[0] / 1e6:.1f} GB/s) min {ceil[1]:.3f} max {ceil[2]:.3f}")
    cfg = kernels.DEFAULT_CONFIG
    want = src[sidx.cpu()].cpu()

    def check(name):
        got = dst[didx_h.to(d1)].cpu()
        print(f"  {name} bytes equal: {torch.equal(got, want)}", flush=True)
        dst.fill_(-7.0)

    try:
        kernels.launch_rows(src, sidx, dst, didx_h.to(d0), cfg)
        torch.cuda.synchronize(0)
        check("push")
        t = timed(lambda: kernels.launch_rows(src, sidx, dst, didx_h.to(d0), cfg))
        print(f"(a) push into ipc: {t[0]:.3f} ms = {100 * ceil[0] / t[0]:.1f} % of the peer copy")
    except Exception as e:
        print("(a) push failed:", type(e).__name__, str(e)[:300])
    try:
        s1, d1i = sidx.to(d1), didx_h.to(d1)
        with torch.cuda.device(1):
            kernels.launch_rows(src, s1, dst, d1i, cfg)
        torch.cuda.synchronize(1)
        check("pull")

        def pull():
            with torch.cuda.device(1):
                kernels.launch_rows(src, s1, dst, d1i, cfg)
        t = timed(pull)
        print(f"(b) pull on cuda:1: {t[0]:.3f} ms = {100 * ceil[0] / t[0]:.1f} % of the peer copy")
    except Exception as e:
        print("(b) pull failed:", type(e).__name__, str(e)[:300]); traceback.print_exc()
    try:
        st0 = torch.empty(ROWS, E, dtype=torch.bfloat16, device=d0)
        st1 = torch.empty(ROWS, E, dtype=torch.bfloat16, device=d1)
        d1i = didx_h.to(d1)
        ar = torch.arange(ROWS, device=d1)

        def staged():
            kernels.launch_rows(src, sidx, st0, None, cfg)
            st1.copy_(st0, non_blocking=True)  # on cuda:0's stream... torch syncs? copy is queued on current stream of src
            torch.cuda.current_stream(d1).wait_stream(torch.cuda.current_stream(d0))
            with torch.cuda.device(1):
                kernels.launch_rows(st1, ar, dst, d1i, cfg)
        staged(); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        check("staged")
        t = timed(staged)
        print(f"(c) staged: {t[0]:.3f} ms = {100 * ceil[0] / t[0]:.1f} % of the peer copy")
    except Exception as e:
        print("(c) staged failed:", type(e).__name__, str(e)[:300]); traceback.print_exc()
    done.set()
    p.join()


if __name__ == "__main__":
    main()
