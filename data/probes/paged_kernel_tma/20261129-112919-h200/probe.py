"""Exploration: does a TMA (bulk tensor copy) row mover beat the LSU kernel on the 32k / 16-token paged table?
Also: does the pool's size (TLB reach) explain the paged->paged gap? Prints and writes CSV to argv[1]."""
import csv, sys, traceback
import torch
import triton
import triton.language as tl
from kvlab import kernels
from kvlab.kernels import KernelConfig

out = sys.argv[1] if len(sys.argv) > 1 else "."
dev = torch.device("cuda")
torch.manual_seed(0)
R, E = 114688, 8192            # 16 KiB rows of bf16
SUB, W = 32, 256               # a row viewed as 32 × 256 bf16 (TMA box dims ≤ 256)
nbytes = R * E * 2
rows = []


def t_ms(fn, reps=15, warm=2):
    for _ in range(warm):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000)
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2], t[0], t[-1]


def add(name, fn, check=None, **kw):
    try:
        med, lo, hi = t_ms(fn)
        ok = check() if check else ""
    except Exception as e:
        traceback.print_exc(limit=2)
        rows.append(dict(name=name, ms="", err=f"{type(e).__name__}: {e}"[:300], **kw)); return
    rows.append(dict(name=name, ms=med, ms_min=lo, ms_max=hi, gbps=nbytes / med / 1e6, ok=ok, **kw))
    print(f"{name:34s} {med*1000:8.1f} us ({lo*1000:.1f}-{hi*1000:.1f})  {nbytes/med/1e6:7.1f} GB/s ok={ok} {kw}", flush=True)


@triton.jit
def tma_rows(src_desc, dst_desc, sidx, didx, R, SUB: tl.constexpr, PARTS: tl.constexpr, PERSIST: tl.constexpr,
             STAGES: tl.constexpr):
    pid = tl.program_id(0)
    if PERSIST:
        step = tl.num_programs(0)
        end = R
    else:
        step = 1
        end = pid + 1
    for t in tl.range(pid, end, step, num_stages=STAGES):
        s = tl.load(sidx + t).to(tl.int32)
        d = tl.load(didx + t).to(tl.int32)
        for p in tl.static_range(PARTS):
            x = src_desc.load([s * SUB + p * (SUB // PARTS), 0])
            dst_desc.store([d * SUB + p * (SUB // PARTS), 0], x)


LS, NB = 56, 2048               # 28 layers × K,V; 2048 blocks of one sequence (same ids in every layer side)


def run_set(P, label):
    """P blocks per layer-side pool; the sequence's 2048 blocks drawn at random from it (src and dst)."""
    pool_rows = LS * P
    src = torch.empty(pool_rows, E, dtype=torch.bfloat16, device=dev).random_(0, 255)
    dst = torch.full((pool_rows, E), float("nan"), dtype=torch.bfloat16, device=dev)
    sid = torch.randperm(P, device=dev)[:NB]
    did = torch.randperm(P, device=dev)[:NB]
    base = (torch.arange(LS, device=dev) * P)[:, None]
    sidx = (base + sid[None, :]).reshape(-1).contiguous()
    didx = (base + did[None, :]).reshape(-1).contiguous()

    def check():
        k = torch.randint(0, R, (512,), device=dev)
        return bool(torch.equal(dst[didx[k]].view(torch.int16), src[sidx[k]].view(torch.int16)))

    add(f"contiguous [{label}]", lambda: dst[:R].copy_(src[:R]), pool=label)
    orders = {"layer(dst-sorted)": torch.argsort(didx), "src-sorted": torch.argsort(sidx),
              "random": torch.randperm(R, device=dev)}
    for oname, perm in orders.items():
        s, d = sidx[perm].contiguous(), didx[perm].contiguous()
        for cfg in (KernelConfig(256, 1, 2, True), KernelConfig(256, 2, 4, True), KernelConfig(512, 1, 4, False)):
            dst.fill_(float("nan"))
            add(f"lsu {oname} [{label}]", lambda s=s, d=d, cfg=cfg: kernels.launch_rows(src, s, dst, d, cfg), check,
                pool=label, cfg=str(cfg.as_dict()))
        if label != "2x" or oname == "random":
            continue
        from triton.tools.tensor_descriptor import TensorDescriptor
        for parts in (1, 2, 4):
            box = [SUB // parts, W]
            sd = TensorDescriptor.from_tensor(src.view(-1, W), box)
            dd = TensorDescriptor.from_tensor(dst.view(-1, W), box)
            for nw in (1, 4):
                dst.fill_(float("nan"))
                add(f"tma {oname} [{label}]",
                    lambda s=s, d=d, sd=sd, dd=dd, parts=parts, nw=nw: tma_rows[(R,)](
                        sd, dd, s, d, R, SUB=SUB, PARTS=parts, PERSIST=False, STAGES=1, num_warps=nw),
                    check, pool=label, cfg=f"box={box} warps={nw} one-row-per-program")
            for per_sm, stages in ((2, 2), (4, 2), (2, 3), (8, 1)):
                grid = torch.cuda.get_device_properties(dev).multi_processor_count * per_sm
                dst.fill_(float("nan"))
                add(f"tma {oname} [{label}]",
                    lambda s=s, d=d, sd=sd, dd=dd, parts=parts, grid=grid, stages=stages: tma_rows[(grid,)](
                        sd, dd, s, d, R, SUB=SUB, PARTS=parts, PERSIST=True, STAGES=stages, num_warps=4),
                    check, pool=label, cfg=f"box={box} persistent {per_sm}/SM stages={stages}")
    del src, dst
    torch.cuda.empty_cache()


for P, label in ((2 * NB, "2x"), (NB, "1x"), (4 * NB, "4x")):
    run_set(P, label)

with open(f"{out}/kernel_tma.csv", "w", newline="") as f:
    keys = sorted({k for r in rows for k in r})
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
print("wrote", len(rows), "rows")
