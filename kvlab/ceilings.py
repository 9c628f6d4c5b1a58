"""Link ceilings: know the link before timing anything.

For every copy path this machine has, sweep the payload size, time each size
with many repeats, and fit the two-part model of seed 004::

    t(bytes) = t0 + bytes / B        (per copy; t0 = fixed cost, B = bandwidth)

The *ceiling* of a path is the best median GB/s measured in the sweep (in
practice at the largest sizes). Every bandwidth reported later in kvlab is
shown beside the ceiling of its path, measured in the same run.

Path names say the path and the mechanism (in the spirit of nvbandwidth):

================  ===========================================================
``d2d_same``      device → device on one GPU, ``copy_`` → cudaMemcpyAsync DtoD
                  (the driver decides between a copy engine and its own kernel)
``d2d_same_sm``   device → device on one GPU through an SM kernel we launch
                  (``bitwise_and(src, -1, out=dst)``: reads and writes every
                  byte once, like a copy kernel — the bound for gather kernels)
``d2d_peer:i->j`` GPU i → GPU j, ``copy_`` → cudaMemcpyAsync on GPU i's stream
                  (copy engine over NVLink/PCIe when peer access is on, else
                  staged by the driver through host memory); ≥ 2 GPUs only
``d2d_peer_sm:i->j`` GPU i → GPU j through kvlab's Triton row-copy kernel on
                  GPU i: SM loads here, SM stores over the link into GPU j's
                  memory (what a gather kernel writing to a peer pool does);
                  ≥ 2 GPUs with peer access and Triton
``d2h_pinned``    GPU → pinned host memory, async copy engine
``h2d_pinned``    pinned host memory → GPU, async copy engine
``d2h_pageable``  GPU → ordinary (pageable) host memory; the driver stages it
``h2h``           host → host ``copy_`` (the only path on a CPU-only machine)
================  ===========================================================

Units: sizes in bytes (``size_bytes``), times in ms (``ms``, per copy), fixed
costs in µs (``fixed_us``), bandwidth in decimal GB/s (``gbps`` = payload
bytes / 1e9 / seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import pandas as pd
import torch

from . import devices
from .timing import fmt_ms, resolve_device, time_fn

__all__ = [
    "KiB", "MiB", "GiB",
    "GPU_SIZES", "CPU_SIZES", "STUDY",
    "available_paths", "valid_paths", "resolve_paths", "parse_size", "resolve_sizes", "fmt_bytes",
    "auto_copies", "measure", "fit_model", "fit", "Fit", "PathCeiling", "Ceilings",
    "summary_table", "plot", "finding_text",
    "add_arguments", "run_args", "ceilings_main",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: 4 KiB … 1 GiB in powers of 4 (10 sizes): the GPU sweep.
GPU_SIZES: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(10))
#: 4 KiB … 16 MiB in powers of 4 (7 sizes): a CPU sweep that runs in about a second.
CPU_SIZES: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(7))
STUDY = "link_ceilings"

# Batch copies until one sample carries about this much payload, so that a
# launch-bound copy (~10 µs) is timed over a window much longer than the event
# resolution (~0.5 µs) and its jitter; capped so small sizes stay quick.
_BATCH_TARGET_BYTES = 4 * MiB
_BATCH_MAX = 64
# Only this fraction of the free memory is planned for: the allocator rounds
# up, and the process (or a neighbour) needs some room of its own.
_FREE_FRACTION = 0.9
_POISON = 0xA5  # destination bytes before the copy; random source bytes differ from it 255 times in 256
_PEER = re.compile(r"^d2d_peer:(\d+)->(\d+)$")
_PEER_SM = re.compile(r"^d2d_peer_sm:(\d+)->(\d+)$")


# --------------------------------------------------------------------------- #
# sizes
# --------------------------------------------------------------------------- #
_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": 1 << 40, "tib": 1 << 40}


def parse_size(value: int | str) -> int:
    """A size in bytes from an int or a string with a binary unit.

    ``4096``, ``"4096"``, ``"4K"``, ``"4KiB"``, ``"1.5M"``, ``"1G"`` → bytes.
    ``"KB"/"MB"/"GB"`` are refused as ambiguous (1000 or 1024?).

    Raises:
        ValueError: not a positive whole number of bytes, or an unknown unit.
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r}: expected a positive int or a string like '4K', '16MiB', '1G'")
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m:
            raise ValueError(f"size {value!r}: expected a positive int or a string like '4K', '16MiB', '1G'")
        unit = m.group(2).lower()
        if unit in ("kb", "mb", "gb", "tb"):
            raise ValueError(f"size {value!r}: {m.group(2)} is ambiguous; write {m.group(2)[0].upper()}iB (binary) or a byte count")
        if unit not in _UNITS:
            raise ValueError(f"size {value!r}: unknown unit {m.group(2)!r}; valid: B, K/KiB, M/MiB, G/GiB, T/TiB")
        x = float(m.group(1)) * _UNITS[unit]
        if x != int(x):
            raise ValueError(f"size {value!r} is {x} bytes, not a whole number of bytes")
        n = int(x)
    else:
        raise ValueError(f"size {value!r}: expected a positive int or a string like '4K', '16MiB', '1G'")
    if n <= 0:
        raise ValueError(f"size {value!r}: must be > 0 bytes")
    return n


def resolve_sizes(sizes: None | str | int | Iterable[int | str], device: torch.device) -> list[int]:
    """Sizes in bytes, ascending and without duplicates.

    ``None`` or ``"auto"`` → :data:`GPU_SIZES` on a CUDA device, :data:`CPU_SIZES`
    on cpu. A comma-separated string (``"4K,1M,1G"``), one size, or a list of
    sizes → parsed with :func:`parse_size`.
    """
    if sizes is None or (isinstance(sizes, str) and sizes.strip() == "auto"):
        return list(GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    if isinstance(sizes, str):
        items: list = [s for s in sizes.split(",") if s.strip()]
    elif isinstance(sizes, (int, np.integer)):
        items = [sizes]
    else:
        items = list(sizes)
    if not items:
        raise ValueError(f"sizes={sizes!r}: no sizes given; pass e.g. '4K,1M' or 'auto'")
    return sorted({parse_size(s) for s in items})


def fmt_bytes(n: float) -> str:
    """``4096 → "4 KiB"``, ``1.5 * 2**20 → "1.5 MiB"``, ``1000 → "1000 B"`` (binary units)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.4g} B"


def auto_copies(size_bytes: int) -> int:
    """Copies per timed sample for a size: enough that a sample moves ~4 MiB, at most 64.

    ``4 KiB → 64``, ``256 KiB → 16``, ``1 MiB → 4``, ``≥ 4 MiB → 1``.
    """
    return max(1, min(_BATCH_MAX, _BATCH_TARGET_BYTES // size_bytes))


# --------------------------------------------------------------------------- #
# paths
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _PathSpec:
    """How one path is built and timed."""

    name: str
    mechanism: str  # what issues the copy (see the module docstring)
    src: torch.device  # where the source buffer lives
    dst: torch.device
    src_pinned: bool = False
    dst_pinned: bool = False
    kernel: bool = False  # True: an SM kernel we launch instead of copy_
    non_blocking: bool = False
    timer: torch.device = torch.device("cpu")  # whose clock times it (the GPU that issues the copy)

    def needs(self, size: int) -> dict[str, int]:
        """Bytes this path allocates at ``size``, by location ("host" or "cuda:N")."""
        need: dict[str, int] = {}
        for dev, pinned in ((self.src, self.src_pinned), (self.dst, self.dst_pinned)):
            key = "host" if dev.type == "cpu" else str(dev)
            # the pinned host allocator rounds a request up to a power of two
            nbytes = 1 << (size - 1).bit_length() if pinned else size
            need[key] = need.get(key, 0) + nbytes
        return need


def _gpu_count(device: torch.device) -> int:
    return torch.cuda.device_count() if device.type == "cuda" else 0


def available_paths(device: str | int | torch.device | None = None) -> list[str]:
    """Paths that ``paths="auto"`` measures here.

    CUDA: d2d_same, d2d_same_sm, every ordered GPU pair ``d2d_peer:i->j`` (≥ 2
    GPUs), d2h_pinned, h2d_pinned, d2h_pageable. CPU: h2h.
    """
    dev = resolve_device(device)
    if dev.type == "cpu":
        return ["h2h"]
    n = _gpu_count(dev)
    peers = [f"d2d_peer:{i}->{j}" for i in range(n) for j in range(n) if i != j]
    from . import kernels

    if n > 1 and kernels.triton_status(dev)[0]:
        peers += [f"d2d_peer_sm:{i}->{j}" for i in range(n) for j in range(n)
                  if i != j and torch.cuda.can_device_access_peer(i, j)]
    return ["d2d_same", "d2d_same_sm", *peers, "d2h_pinned", "h2d_pinned", "d2h_pageable"]


def valid_paths(device: str | int | torch.device | None = None) -> list[str]:
    """Every path name accepted here: :func:`available_paths` plus ``h2h`` on a GPU machine."""
    names = available_paths(device)
    return names if "h2h" in names else names + ["h2h"]


def resolve_paths(paths: None | str | Iterable[str], device: str | int | torch.device | None = None) -> list[str]:
    """Path names to measure, validated, in the order given, without duplicates.

    ``None``/``"auto"`` → :func:`available_paths`. A comma-separated string or a
    list of names. ``"d2d_peer"`` alone expands to every ordered GPU pair.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or no names.
    """
    dev = resolve_device(device)
    if paths is None or (isinstance(paths, str) and paths.strip() == "auto"):
        return available_paths(dev)
    items = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else [str(p).strip() for p in paths]
    items = [p for p in items if p]
    if not items:
        raise ValueError(f"paths={paths!r}: no path names given; valid: {valid_paths(dev)} or 'auto'")
    valid = valid_paths(dev)
    out: list[str] = []
    for p in items:
        expanded = [v for v in valid if v.startswith("d2d_peer:")] if p == "d2d_peer" else [p]
        if p == "d2d_peer" and not expanded:
            raise ValueError(f"path 'd2d_peer' needs two or more GPUs; this machine has {_gpu_count(dev)}. Valid: {valid}")
        for q in expanded:
            if q not in valid:
                raise ValueError(f"unknown path {q!r} on this machine; valid: {valid}")
            if q not in out:
                out.append(q)
    return out


def _spec(name: str, dev: torch.device) -> _PathSpec:
    cpu = torch.device("cpu")
    if name == "h2h":
        return _PathSpec(name, "host_copy", cpu, cpu, timer=cpu)
    if name == "d2d_same":
        return _PathSpec(name, "memcpy_d2d", dev, dev, timer=dev)
    if name == "d2d_same_sm":
        return _PathSpec(name, "sm_kernel", dev, dev, kernel=True, timer=dev)
    if name == "d2h_pinned":
        return _PathSpec(name, "copy_engine", dev, cpu, dst_pinned=True, non_blocking=True, timer=dev)
    if name == "h2d_pinned":
        return _PathSpec(name, "copy_engine", cpu, dev, src_pinned=True, non_blocking=True, timer=dev)
    if name == "d2h_pageable":
        # non_blocking would not help: a copy into pageable memory returns to
        # the host only once the bytes are there
        return _PathSpec(name, "staged_memcpy", dev, cpu, timer=dev)
    m = _PEER_SM.match(name)
    if m:
        src, dst = torch.device("cuda", int(m.group(1))), torch.device("cuda", int(m.group(2)))
        return _PathSpec(name, "sm_store_p2p", src, dst, kernel=True, timer=src)
    m = _PEER.match(name)
    if m:
        i, j = int(m.group(1)), int(m.group(2))
        src, dst = torch.device("cuda", i), torch.device("cuda", j)
        p2p = bool(torch.cuda.can_device_access_peer(i, j))
        # torch issues a cross-device copy on the source GPU's current stream
        return _PathSpec(name, "copy_engine_p2p" if p2p else "staged_no_p2p", src, dst, timer=src)
    raise ValueError(f"unknown path {name!r}")  # resolve_paths() has already refused it


# --------------------------------------------------------------------------- #
# free memory
# --------------------------------------------------------------------------- #
def _host_available_bytes() -> int:
    avail = devices.host_available_bytes()
    return avail if avail is not None else 1 << 62  # unknown: do not refuse


def _free_bytes(location: str) -> int:
    if location == "host":
        return _host_available_bytes()
    dev = torch.device(location)
    free, _total = torch.cuda.mem_get_info(dev)
    # memory torch's caching allocator holds but does not use is free to us too
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int(free + cached)


def _check_fits(specs: Sequence[_PathSpec], sizes: Sequence[int]) -> None:
    """Refuse, before allocating, a size that some path cannot hold.

    Paths and sizes run one at a time and free their buffers, so what must fit
    is each single (path, size) case, against the memory free now.
    """
    free: dict[str, int] = {}

    def fits(spec: _PathSpec, size: int) -> str | None:
        """None if the case fits, else the location that is short."""
        for loc, need in spec.needs(size).items():
            if loc not in free:
                free[loc] = _free_bytes(loc)
            if need > free[loc] * _FREE_FRACTION:
                return loc
        return None

    for spec in specs:
        for size in sorted(sizes, reverse=True):
            loc = fits(spec, size)
            if loc is None:
                break  # smaller sizes need less
            ok = [s for s in sizes if fits(spec, s) is None]
            hint = f"the largest requested size that fits is {fmt_bytes(max(ok))}" if ok else "no requested size fits"
            raise ValueError(
                f"size {fmt_bytes(size)} ({size} bytes) on path {spec.name!r} needs "
                f"{fmt_bytes(spec.needs(size)[loc])} on {loc}, but only {fmt_bytes(free[loc])} is free there "
                f"(kvlab plans for {_FREE_FRACTION:.0%} of it); {hint}"
            )


# --------------------------------------------------------------------------- #
# one (path, size) case
# --------------------------------------------------------------------------- #
def _alloc(size: int, dev: torch.device, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return torch.empty(size, dtype=torch.uint8, device=dev)


class _Case:
    """Buffers of one path at one size, filled, and the copy to time.

    src: uint8 [size], random bytes (not zeros: no page may stay untouched and
    nothing compressible may flatter a link). dst: uint8 [size], poisoned with
    0xA5 so a copy that did not happen shows in :meth:`verify`.
    """

    def __init__(self, spec: _PathSpec, size: int, seed: int):
        self.spec, self.size = spec, size
        self.src = _alloc(size, spec.src, spec.src_pinned)
        self.dst = _alloc(size, spec.dst, spec.dst_pinned)
        gen = torch.Generator(device=self.src.device)
        gen.manual_seed(seed)
        self.src.random_(0, 256, generator=gen)  # in place: no second buffer of `size` bytes
        self.dst.fill_(_POISON)
        if spec.mechanism == "sm_store_p2p":
            # rows of 16 KiB (the paged caches' block row) moved by the row-copy kernel, as a paged gather
            # into a peer pool would; a tail shorter than a row goes by copy_
            from . import kernels

            # a copy each way turns peer access on (torch does it on first use) before a kernel stores across
            self.dst[:1].copy_(self.src[:1])
            self.src[:1].copy_(self.dst[:1])
            row = 16 * KiB if size >= 16 * KiB else size
            n = size // row
            self._rows = (self.src[: n * row].view(n, row), self.dst[: n * row].view(n, row),
                          torch.arange(n, dtype=torch.int64, device=spec.src))
            self._tail = size - n * row
            self._kernels = kernels
        elif spec.kernel:
            # 4-byte words when possible: the elementwise kernel then moves 16 B per vector load
            if size % 4 == 0:
                self._ksrc, self._kdst, self._mask = self.src.view(torch.int32), self.dst.view(torch.int32), -1
            else:
                self._ksrc, self._kdst, self._mask = self.src, self.dst, 0xFF

    def copy(self) -> None:
        """One copy of ``size`` bytes from src to dst, enqueued on the current stream."""
        if self.spec.mechanism == "sm_store_p2p":
            s, d, idx = self._rows
            self._kernels.launch_rows(s, idx, d, None, self._kernels.DEFAULT_CONFIG)
            if self._tail:
                self.dst[-self._tail:].copy_(self.src[-self._tail:], non_blocking=True)
        elif self.spec.kernel:
            torch.bitwise_and(self._ksrc, self._mask, out=self._kdst)
        else:
            self.dst.copy_(self.src, non_blocking=self.spec.non_blocking)

    def verify(self, samples: int = 4096) -> None:
        """Compare dst with src at the first/last 4 KiB and ``samples`` random offsets.

        A sample rather than every byte: a full compare of a host buffer would
        cost another copy of the whole size. Waits for the copies to finish.
        """
        if self.spec.timer.type == "cuda":
            torch.cuda.synchronize(self.spec.timer)
            if self.spec.dst.type == "cuda":
                torch.cuda.synchronize(self.spec.dst)
        edge = min(self.size, 4 * KiB)
        gen = torch.Generator().manual_seed(self.size)
        idx = torch.cat([
            torch.arange(edge),
            torch.arange(self.size - edge, self.size),
            torch.randint(0, self.size, (samples,), generator=gen),
        ])
        a = self.src[idx.to(self.src.device)].cpu()
        b = self.dst[idx.to(self.dst.device)].cpu()
        if not torch.equal(a, b):
            bad = int((a != b).sum())
            raise RuntimeError(
                f"path {self.spec.name!r} at {fmt_bytes(self.size)}: {bad} of {idx.numel()} sampled bytes of the "
                f"destination differ from the source after the copy — the timing would be of a copy that did not happen"
            )

    def release(self) -> None:
        del self.src, self.dst
        if self.spec.mechanism == "sm_store_p2p":
            del self._rows
        elif self.spec.kernel:
            del self._ksrc, self._kdst


# --------------------------------------------------------------------------- #
# measure
# --------------------------------------------------------------------------- #
def _progress(total: int, enabled: bool):
    """A tqdm bar: the notebook widget in a live Jupyter kernel, text on stderr elsewhere."""
    try:
        from . import nbtools
        interactive = nbtools.is_interactive()
    except ImportError:
        interactive = False
    if interactive:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    return tqdm(total=total, disable=not enabled, desc="link ceilings", unit="case")


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def measure(
    paths: None | str | Iterable[str] = None,
    sizes: None | str | int | Iterable[int | str] = None,
    n: int = 9,
    warmup: int = 3,
    device: str | int | torch.device | None = None,
    copies: int | str = "auto",
    progress: bool = True,
    seed: int = 0,
) -> pd.DataFrame:
    """Time every (path, size): one row per timed sample.

    Args:
        paths: names (see the module docstring), comma-separated or a list;
            ``None``/``"auto"`` = :func:`available_paths`.
        sizes: payload bytes per copy; ints or strings like ``"16K"``;
            ``None``/``"auto"`` = 4 KiB … 1 GiB on a GPU, 4 KiB … 16 MiB on cpu.
        n: timed samples per (path, size), >= 1 (publish with n >= 9).
        warmup: untimed samples first, >= 0.
        device: the GPU of the same-GPU and host paths (default: the current
            CUDA device, else cpu). Peer paths name their own GPUs.
        copies: copies per timed sample. ``"auto"`` = :func:`auto_copies`
            (64 back-to-back copies of a 4 KiB buffer per event pair, 1 copy from
            4 MiB up); an int forces it. A sample's time is divided by it.
        progress: show a tqdm bar.
        seed: seeds the random source bytes.

    Each size's buffers are allocated once, the source filled with random
    bytes and the destination poisoned; after timing, the destination is
    checked against the source (RuntimeError if a copy did not land).

    Returns:
        Tidy DataFrame, columns ``path`` (str), ``mechanism`` (str),
        ``size_bytes`` (int), ``copies_per_sample`` (int), ``repeat`` (int,
        0..n-1), ``ms`` (float, time per copy), ``gbps`` (float, decimal GB/s
        of payload). ``df.attrs`` holds ``device`` (name), ``p2p`` (peer-access
        matrix, ``[]`` without CUDA), ``n``, ``warmup``.

    Raises:
        ValueError: unknown path, size <= 0 or unparsable, n < 1, warmup < 0,
            copies < 1, or a size that does not fit in free device/host memory
            — all before anything is allocated.
    """
    from .timing import _check_int

    n = _check_int("n", n, 1)
    warmup = _check_int("warmup", warmup, 0)
    if not (isinstance(copies, str) and copies == "auto"):
        copies = _check_int("copies", copies, 1)
    dev = resolve_device(device)
    names = resolve_paths(paths, dev)
    size_list = resolve_sizes(sizes, dev)
    specs = [_spec(name, dev) for name in names]
    _check_fits(specs, size_list)

    rows: list[tuple] = []
    bar = _progress(len(specs) * len(size_list), progress)
    try:
        for spec in specs:
            for size in size_list:
                bar.set_postfix_str(f"{spec.name} {fmt_bytes(size)}")
                k = auto_copies(size) if copies == "auto" else copies
                case = _Case(spec, size, seed)

                def sample(case=case, k=k):
                    for _ in range(k):
                        case.copy()

                # time_fn makes the timing GPU current, so a peer copy is issued
                # from (and timed on) its source GPU's stream
                ms = time_fn(sample, n=n, warmup=warmup, device=spec.timer)
                case.verify()
                case.release()
                for r, t in enumerate(ms):
                    per_copy = t / k
                    gbps = size / (per_copy / 1e3) / 1e9 if per_copy > 0 else float("inf")
                    rows.append((spec.name, spec.mechanism, size, k, r, per_copy, gbps))
                bar.update(1)
    finally:
        bar.close()
    df = pd.DataFrame(rows, columns=["path", "mechanism", "size_bytes", "copies_per_sample", "repeat", "ms", "gbps"])
    df.attrs.update(device=_device_name(dev), p2p=devices.p2p_matrix() if dev.type == "cuda" else [], n=n, warmup=warmup)
    return df


# --------------------------------------------------------------------------- #
# fit
# --------------------------------------------------------------------------- #
def fit_model(size_bytes: Sequence[float], ms: Sequence[float]) -> tuple[float, float, float]:
    """Fit ``ms = t0 + size / B`` to per-size times, minimising *relative* error.

    Least squares on ``(t0 + size·b − t) / t``: every size weighs the same in
    proportion, so the small sizes (where t ≈ t0) pin the fixed cost and the
    large ones (where t ≈ size/B) pin the bandwidth — an unweighted fit would
    let the 1 GiB point swallow t0 whole. Constrained to t0 ≥ 0 and b ≥ 0.

    Args:
        size_bytes: payload per copy, bytes, >= 2 distinct values.
        ms: time per copy at each size, ms, > 0 (usually the median).

    Returns:
        ``(fixed_us, bandwidth_gbps, max_rel_err)``: t0 in µs, B in decimal
        GB/s (``inf`` if time does not grow with size), and the largest
        ``|fit − t| / t`` over the points.

    Raises:
        ValueError: mismatched lengths, fewer than 2 distinct sizes, or a
            non-positive or non-finite size or time.
    """
    s = np.asarray(size_bytes, dtype=np.float64).reshape(-1)
    t = np.asarray(ms, dtype=np.float64).reshape(-1)
    if s.shape != t.shape:
        raise ValueError(f"fit_model: {s.size} sizes but {t.size} times; pass one time per size")
    if np.unique(s).size < 2:
        raise ValueError(f"fit_model needs >= 2 distinct sizes to separate fixed cost from bandwidth; got {s.tolist()}")
    if not (np.all(np.isfinite(s)) and np.all(s > 0) and np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError(f"fit_model: sizes and times must be finite and > 0; got sizes {s.tolist()}, ms {t.tolist()}")
    g = s / 1e9  # GB, so b comes out in ms per GB and the two columns are of similar scale
    a = np.column_stack([1.0 / t, g / t])
    scale = np.linalg.norm(a, axis=0)
    coef, *_ = np.linalg.lstsq(a / scale, np.ones_like(t), rcond=None)
    t0, b = coef / scale
    if t0 < 0:
        # all fixed cost attributed to bandwidth: min Σ((g·b − t)/t)²
        t0, b = 0.0, float(np.sum(g / t) / np.sum(g**2 / t**2))
    if b * g.max() <= 1e-9 * np.min(t):
        # time does not grow with size (b is at most rounding noise): a pure fixed cost, min Σ((t0 − t)/t)²
        t0, b = float(np.sum(1.0 / t) / np.sum(1.0 / t**2)), 0.0
    pred = t0 + g * b
    max_rel = float(np.max(np.abs(pred - t) / t))
    bandwidth_gbps = 1e3 / b if b > 0 else math.inf  # b ms per GB → GB per s
    return float(t0 * 1e3), float(bandwidth_gbps), max_rel


@dataclass(frozen=True)
class PathCeiling:
    """The measured ceiling and the fitted model of one path.

    Attributes:
        path, mechanism: as in :func:`measure`.
        fixed_us: fitted fixed cost per copy, µs (NaN when fewer than 2 sizes).
        bandwidth_gbps: fitted bandwidth B, decimal GB/s (NaN as above; inf if
            time did not grow with size).
        ceiling_gbps: best per-size median GB/s — the number later bandwidths
            on this path are compared with.
        ceiling_min_gbps, ceiling_max_gbps: min and max GB/s of the samples at
            that size.
        ceiling_size_bytes: the size where the ceiling was measured.
        half_size_bytes: ``t0·B``, the copy size at which the fit reaches half
            of B (smaller copies are launch-bound).
        n_sizes: sizes measured; max_rel_err: largest relative fit error.
    """

    path: str
    mechanism: str
    fixed_us: float
    bandwidth_gbps: float
    ceiling_gbps: float
    ceiling_min_gbps: float
    ceiling_max_gbps: float
    ceiling_size_bytes: int
    half_size_bytes: float
    n_sizes: int
    max_rel_err: float

    @property
    def has_fit(self) -> bool:
        return math.isfinite(self.fixed_us) and not math.isnan(self.bandwidth_gbps)


def _json_float(x):
    # JSON has no NaN/inf; strings survive json.dump and float() reads them back
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


@dataclass
class Ceilings:
    """Ceilings and fits of every measured path, with where they were measured.

    ``paths``: path name → :class:`PathCeiling`. ``device``: GPU name or
    ``"cpu"``. ``p2p``: the peer-access matrix at measurement time. ``meta``:
    free-form (n, warmup, run id …).
    """

    paths: dict[str, PathCeiling]
    device: str = ""
    p2p: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    # -- lookup ------------------------------------------------------------- #
    def __contains__(self, path: str) -> bool:
        return path in self.paths

    def __getitem__(self, path: str) -> PathCeiling:
        if path not in self.paths:
            raise ValueError(f"no ceiling for path {path!r}; measured: {sorted(self.paths)}")
        return self.paths[path]

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def gbps(self, path: str) -> float:
        """The ceiling of ``path``, decimal GB/s (best median of the sweep)."""
        return self[path].ceiling_gbps

    def fixed_us(self, path: str) -> float:
        """Fitted fixed cost per copy of ``path``, µs."""
        return self[path].fixed_us

    def bandwidth_gbps(self, path: str) -> float:
        """Fitted bandwidth B of ``path``, decimal GB/s."""
        return self[path].bandwidth_gbps

    def predict_ms(self, path: str, nbytes: float, copies: int = 1) -> float:
        """Predicted ms to move ``nbytes`` in total as ``copies`` back-to-back copies.

        ``copies · t0 + nbytes / B`` — seed 004's model: its 32k cache was 56
        copies (K and V of 28 layers) of 1.88 GB in total.

        Raises:
            ValueError: unknown path, a path without a fit, ``nbytes < 0``, or
                ``copies`` not an int >= 1.
        """
        from .timing import _check_int

        pc = self[path]
        copies = _check_int("copies", copies, 1)
        if not (isinstance(nbytes, (int, float, np.integer, np.floating)) and math.isfinite(nbytes) and nbytes >= 0):
            raise ValueError(f"nbytes={nbytes!r}: expected a finite number of bytes >= 0")
        if not pc.has_fit:
            raise ValueError(f"path {path!r} has no fit (measured at {pc.n_sizes} size(s); the fit needs >= 2)")
        bytes_ms = 0.0 if math.isinf(pc.bandwidth_gbps) else nbytes / (pc.bandwidth_gbps * 1e9) * 1e3
        return copies * pc.fixed_us / 1e3 + bytes_ms

    def fraction(self, path: str, gbps: float) -> float:
        """``gbps`` as a fraction of the ceiling of ``path`` (1.0 = at the ceiling)."""
        return float(gbps) / self.gbps(path)

    # -- tables and JSON ------------------------------------------------------ #
    def table(self) -> pd.DataFrame:
        """One row per path, the :class:`PathCeiling` fields as columns."""
        return pd.DataFrame([asdict(pc) for pc in self.paths.values()], columns=[f.name for f in fields(PathCeiling)])

    @classmethod
    def from_table(cls, table: pd.DataFrame, device: str = "", p2p: list | None = None, meta: dict | None = None) -> "Ceilings":
        """Inverse of :meth:`table` (e.g. from a run's fit.csv)."""
        missing = [f.name for f in fields(PathCeiling) if f.name not in table.columns]
        if missing:
            raise ValueError(f"fit table lacks columns {missing}; expected those of PathCeiling")
        paths = {}
        for rec in table.to_dict("records"):
            kw = {f.name: rec[f.name] for f in fields(PathCeiling)}
            kw["ceiling_size_bytes"], kw["n_sizes"] = int(kw["ceiling_size_bytes"]), int(kw["n_sizes"])
            for k in ("fixed_us", "bandwidth_gbps", "ceiling_gbps", "ceiling_min_gbps", "ceiling_max_gbps",
                      "half_size_bytes", "max_rel_err"):
                kw[k] = float(kw[k])
            paths[str(kw["path"])] = PathCeiling(**kw)
        return cls(paths, device, list(p2p or []), dict(meta or {}))

    def to_dict(self) -> dict:
        """JSON-ready dict (NaN/inf written as the strings "nan"/"inf"); store it with ``run.update(ceilings=...)``."""
        return {
            "device": self.device,
            "p2p": self.p2p,
            "meta": self.meta,
            "paths": {name: {k: _json_float(v) for k, v in asdict(pc).items()} for name, pc in self.paths.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, data: str | dict) -> "Ceilings":
        """Inverse of :meth:`to_json` / :meth:`to_dict` (accepts either)."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict) or "paths" not in data:
            raise ValueError("Ceilings.from_json: expected a dict (or JSON text) with a 'paths' key, as to_dict() writes")
        table = pd.DataFrame(list(data["paths"].values()))
        return cls.from_table(table, data.get("device", ""), data.get("p2p") or [], data.get("meta") or {})

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> "Ceilings":
        """The ceilings a link-ceilings run stored in ``<run_dir>/run.json`` under ``"ceilings"``."""
        path = Path(run_dir) / "run.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; pass a run directory written by notebooks/01_link_ceilings")
        data = json.loads(path.read_text())
        if "ceilings" not in data:
            raise ValueError(f"{path} has no 'ceilings' entry; it is not a link-ceilings run")
        return cls.from_json(data["ceilings"])


class Fit(NamedTuple):
    """What :func:`fit` returns: ``table`` (one row per path) and ``ceilings``."""

    table: pd.DataFrame
    ceilings: Ceilings


def _per_size(df: pd.DataFrame) -> pd.DataFrame:
    """Median/min/max of ms and GB/s per (path, size)."""
    g = df.groupby(["path", "size_bytes"], sort=False)
    out = g.agg(
        mechanism=("mechanism", "first"),
        copies_per_sample=("copies_per_sample", "first"),
        n=("ms", "size"),
        ms=("ms", "median"),
        ms_min=("ms", "min"),
        ms_max=("ms", "max"),
        gbps=("gbps", "median"),
        gbps_min=("gbps", "min"),
        gbps_max=("gbps", "max"),
    ).reset_index()
    # paths in the order they were measured, sizes ascending
    order = {p: i for i, p in enumerate(dict.fromkeys(df["path"]))}
    out["_order"] = out["path"].map(order)
    return out.sort_values(["_order", "size_bytes"]).drop(columns="_order").reset_index(drop=True)


_REQUIRED = ("path", "size_bytes", "ms", "gbps")


def fit(df: pd.DataFrame) -> Fit:
    """Fit fixed cost + bandwidth per path and take each path's ceiling.

    Args:
        df: :func:`measure`'s tidy table (or the same columns read back from
            results.csv: ``path``, ``size_bytes``, ``ms``, ``gbps``; ``mechanism``
            optional).

    Returns:
        :class:`Fit` ``(table, ceilings)``; ``table`` has one row per path with
        the :class:`PathCeiling` columns. A path measured at one size gets a
        ceiling but NaN for the fit.

    Raises:
        ValueError: missing columns or an empty table.
    """
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"fit() needs the DataFrame from measure(), got {type(df).__name__}")
    missing = [c for c in _REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"fit(): the table lacks columns {missing}; expected {list(_REQUIRED)} as measure() writes")
    if df.empty:
        raise ValueError("fit(): the table has no rows")
    if "mechanism" not in df.columns:
        df = df.assign(mechanism="")
    if "copies_per_sample" not in df.columns:
        df = df.assign(copies_per_sample=1)
    per = _per_size(df)
    paths: dict[str, PathCeiling] = {}
    for path, g in per.groupby("path", sort=False):
        best = g.loc[g["gbps"].idxmax()]
        if g["size_bytes"].nunique() >= 2:
            t0_us, bw, err = fit_model(g["size_bytes"], g["ms"])
        else:
            t0_us, bw, err = math.nan, math.nan, math.nan
        half = t0_us / 1e6 * bw * 1e9 if math.isfinite(t0_us) and math.isfinite(bw) else math.nan
        paths[str(path)] = PathCeiling(
            path=str(path),
            mechanism=str(best["mechanism"]),
            fixed_us=t0_us,
            bandwidth_gbps=bw,
            ceiling_gbps=float(best["gbps"]),
            ceiling_min_gbps=float(best["gbps_min"]),
            ceiling_max_gbps=float(best["gbps_max"]),
            ceiling_size_bytes=int(best["size_bytes"]),
            half_size_bytes=half,
            n_sizes=int(g["size_bytes"].nunique()),
            max_rel_err=err,
        )
    meta = {k: df.attrs[k] for k in ("n", "warmup") if k in df.attrs}
    ceil = Ceilings(paths, device=str(df.attrs.get("device", "")), p2p=list(df.attrs.get("p2p", [])), meta=meta)
    return Fit(ceil.table(), ceil)


# --------------------------------------------------------------------------- #
# presentation
# --------------------------------------------------------------------------- #
def _as_ceilings(c: "Ceilings | Fit | pd.DataFrame") -> Ceilings:
    if isinstance(c, Ceilings):
        return c
    if isinstance(c, Fit):
        return c.ceilings
    if isinstance(c, pd.DataFrame):
        return Ceilings.from_table(c)
    raise ValueError(f"expected Ceilings, Fit or a fit table, got {type(c).__name__}")


def _fmt_time_range(median_ms: float, lo_ms: float, hi_ms: float) -> str:
    """``"11.8 (11.2–13) µs"``: all three in the unit :func:`fmt_ms` picks for the median."""
    value, unit = fmt_ms(median_ms).rsplit(" ", 1)
    scale = {"ns": 1e6, "µs": 1e3, "ms": 1.0, "s": 1e-3}[unit]

    def g(x: float) -> str:  # 3 significant digits, but never scientific notation
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"

    return f"{value} ({g(lo_ms * scale)}–{g(hi_ms * scale)}) {unit}"


def summary_table(df: pd.DataFrame, ceilings: "Ceilings | Fit | pd.DataFrame") -> pd.DataFrame:
    """One row per (path, size) for a notebook: median with min–max, GB/s, % of ceiling, fit.

    Columns: ``path``, ``size`` (e.g. "16 KiB"), ``size_bytes``,
    ``copies_per_sample``, ``time per copy`` (str, "median (min–max)" in
    µs/ms/s), ``ms`` (median, per copy), ``gbps`` / ``gbps_min`` /
    ``gbps_max``, ``pct_of_ceiling`` (median GB/s / ceiling × 100),
    ``fit_ms`` (the model's time), ``fit_err_pct`` ((fit − median)/median × 100).
    """
    ceil = _as_ceilings(ceilings)
    per = _per_size(df)
    rows = []
    for r in per.itertuples(index=False):
        pc = ceil.paths.get(r.path)
        fit_ms = ceil.predict_ms(r.path, r.size_bytes) if pc is not None and pc.has_fit else math.nan
        rows.append({
            "path": r.path,
            "size": fmt_bytes(r.size_bytes),
            "size_bytes": int(r.size_bytes),
            "copies_per_sample": int(r.copies_per_sample),
            "time per copy": _fmt_time_range(r.ms, r.ms_min, r.ms_max),
            "ms": r.ms,
            "gbps": r.gbps,
            "gbps_min": r.gbps_min,
            "gbps_max": r.gbps_max,
            "pct_of_ceiling": 100.0 * r.gbps / pc.ceiling_gbps if pc is not None else math.nan,
            "fit_ms": fit_ms,
            "fit_err_pct": 100.0 * (fit_ms - r.ms) / r.ms,
        })
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, ceilings: "Ceilings | Fit | pd.DataFrame", ax=None, title: str | None = None):
    """GB/s against copy size, one colour per path.

    Measured medians with min–max error bars, the fitted ``t0 + bytes/B``
    curve dashed, the path's ceiling as a dotted horizontal line; the legend
    names each path's fixed µs, fitted GB/s and ceiling. Log–log axes, sizes
    labelled in binary units.

    Returns:
        The matplotlib Figure (pass it to ``kvlab.plots.save(fig, "gbps_vs_size", run)``).
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ceil = _as_ceilings(ceilings)
    per = _per_size(df)
    own_figure = ax is None
    if own_figure:
        # constrained layout keeps room for the legend below the axes, inside the figure (the
        # footer kvlab.plots.save adds hangs below the figure's edge and must not cover it)
        fig = plt.figure(figsize=(9, 6.5), layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    names = list(dict.fromkeys(per["path"]))
    try:
        from . import plots

        colors = plots.palette(names)  # the house palette: distinct, colour-blind safe
    except ImportError:
        cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
        colors = {p: cycle[i % len(cycle)] for i, p in enumerate(names)}
    markers = "osD^vPX*"  # paired paths (d2h/h2d, i->j/j->i) often overlap: shapes tell them apart
    for k, (path, g) in enumerate(per.groupby("path", sort=False)):
        color, marker = colors[path], markers[k % len(markers)]
        pc = ceil.paths.get(path)
        label = path
        if pc is not None and pc.has_fit:
            bw = "∞" if math.isinf(pc.bandwidth_gbps) else f"{pc.bandwidth_gbps:,.4g}"
            label = f"{path}: {pc.fixed_us:.3g} µs + {bw} GB/s; ceiling {pc.ceiling_gbps:,.4g} GB/s"
        elif pc is not None:
            label = f"{path}: ceiling {pc.ceiling_gbps:,.4g} GB/s"
        yerr = np.vstack([g["gbps"] - g["gbps_min"], g["gbps_max"] - g["gbps"]])
        ax.errorbar(g["size_bytes"], g["gbps"], yerr=yerr, fmt=marker, ms=4, capsize=3, color=color, label=label)
        if pc is not None and pc.has_fit:
            s = np.geomspace(g["size_bytes"].min(), g["size_bytes"].max(), 200)
            t_s = pc.fixed_us / 1e6 + (0.0 if math.isinf(pc.bandwidth_gbps) else s / (pc.bandwidth_gbps * 1e9))
            ax.plot(s, s / t_s / 1e9, "--", color=color, lw=1.2)
        if pc is not None:
            ax.axhline(pc.ceiling_gbps, ls=":", color=color, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted(per["size_bytes"].unique())
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(sizes, [fmt_bytes(s).replace(" ", "\u2009") for s in sizes], rotation=45, ha="right")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:,.4g}"))
    ax.set_xlabel("bytes per copy")
    ax.set_ylabel("GB/s (decimal, payload bytes)")
    n = df.attrs.get("n", int(df.groupby(["path", "size_bytes"]).size().min()))
    ax.set_title(title or f"Copy bandwidth vs size — {ceil.device or 'device'}\n"
                          f"median of {n} (bars: min–max); dashed: fit t0 + bytes/B; dotted: ceiling", fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    if own_figure:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2 if len(names) > 3 else 1,
                   fontsize=8)
    else:
        ax.legend(fontsize=8, loc="lower right")
    return fig


def finding_text(df: pd.DataFrame, ceilings: "Ceilings | Fit | pd.DataFrame", probe_bytes: int = 16 * KiB) -> str:
    """A few Markdown bullets stating what the sweep found, all numbers from ``df``/``ceilings``.

    Per path: the ceiling and where it was reached, the fitted fixed cost and
    bandwidth, the size needed for half the bandwidth, and what a
    ``probe_bytes`` copy (default 16 KiB, one paged-KV block) achieves — called
    launch-bound when the fixed cost exceeds its bytes' time.
    """
    ceil = _as_ceilings(ceilings)
    per = _per_size(df)
    lines = []
    for path, g in per.groupby("path", sort=False):
        pc = ceil.paths.get(path)
        if pc is None:
            continue
        line = (f"- **{path}** ({pc.mechanism}): ceiling **{pc.ceiling_gbps:,.4g} GB/s** "
                f"(min–max {pc.ceiling_min_gbps:,.4g}–{pc.ceiling_max_gbps:,.4g}) at {fmt_bytes(pc.ceiling_size_bytes)}")
        if pc.has_fit:
            bw = "unbounded" if math.isinf(pc.bandwidth_gbps) else f"{pc.bandwidth_gbps:,.4g} GB/s"
            line += (f"; fit: {pc.fixed_us:.3g} µs fixed per copy + bytes at {bw} "
                     f"(within {100 * pc.max_rel_err:.0f}% at every size)")
            if math.isfinite(pc.half_size_bytes):
                line += f"; copies under {fmt_bytes(pc.half_size_bytes)} get less than half the fitted bandwidth"
        probe = g[g["size_bytes"] == probe_bytes]
        if not probe.empty:
            p = probe.iloc[0]
            pct = 100.0 * p["gbps"] / pc.ceiling_gbps
            line += f". A {fmt_bytes(probe_bytes)} copy takes {fmt_ms(p['ms'])} ({pct:.2g}% of the ceiling)"
            if pc.has_fit and not math.isinf(pc.bandwidth_gbps):
                bytes_us = probe_bytes / (pc.bandwidth_gbps * 1e9) * 1e6
                bound = "launch-bound" if pc.fixed_us > bytes_us else "bandwidth-bound"
                line += f": {bound} ({pc.fixed_us:.3g} µs fixed vs {bytes_us:.3g} µs of bytes)"
        lines.append(line + ".")
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# command line: `kvlab ceilings`
# --------------------------------------------------------------------------- #
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kvlab ceilings`` options to ``parser`` (for a CLI subparser)."""
    parser.add_argument("--paths", nargs="+", default=["auto"],
                        help="path names (space- or comma-separated), 'd2d_peer' for every GPU pair, or auto")
    parser.add_argument("--sizes", nargs="+", default=["auto"],
                        help="bytes per copy, e.g. 4K 1M 1G (binary units), or auto (GPU 4K..1G, CPU 4K..16M)")
    parser.add_argument("-n", "--repeats", type=int, default=9, help="timed samples per (path, size) (default 9)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed samples first (default 3)")
    parser.add_argument("--copies", default="auto", help="copies per sample: auto or an int")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: current GPU, else cpu)")
    parser.add_argument("--run-dir", default="", help="write into this run directory (default: a new one)")
    parser.add_argument("--no-save", action="store_true", help="print only; write no run")
    return parser


def _join(values: list[str]) -> str:
    return ",".join(v for item in values for v in item.split(",") if v)


def run_args(args: argparse.Namespace) -> int:
    """Run ``kvlab ceilings`` from parsed arguments; returns the exit status."""
    try:
        copies = args.copies if args.copies == "auto" else int(args.copies)
    except ValueError:
        print(f"kvlab ceilings: error: --copies {args.copies!r}: expected 'auto' or an int >= 1", file=sys.stderr)
        return 2
    params = {"paths": _join(args.paths), "sizes": _join(args.sizes), "repeats": args.repeats,
              "warmup": args.warmup, "copies": copies, "device": args.device}
    try:
        df = measure(params["paths"], params["sizes"], n=args.repeats, warmup=args.warmup,
                     device=args.device, copies=copies)
    except ValueError as exc:
        print(f"kvlab ceilings: error: {exc}", file=sys.stderr)
        return 2
    table, ceil = fit(df)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(summary_table(df, ceil).drop(columns=["size_bytes"]).to_string(index=False))
        print()
        print(table.to_string(index=False))
    print()
    print(finding_text(df, ceil))
    if not args.no_save:
        from . import results

        run = results.start(STUDY, params, args.run_dir)
        run.save_table(df, "results")
        run.save_table(table, "fit")
        run.update(ceilings=ceil.to_dict())
        run.finish()
        print(f"\nwrote {run.dir}")
    return 0


def ceilings_main(argv: Sequence[str] | None = None) -> int:
    """``kvlab ceilings [--paths ...] [--sizes ...] [-n 9] [--warmup 3] [--run-dir DIR] [--no-save]``.

    Measures, fits, prints the tables and the finding, and writes a
    ``link_ceilings`` run (results.csv, fit.csv, ``ceilings`` in run.json).
    Returns the exit status (0 ok, 2 bad input).
    """
    parser = add_arguments(argparse.ArgumentParser(prog="kvlab ceilings", description=ceilings_main.__doc__.splitlines()[0]))
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(ceilings_main())
