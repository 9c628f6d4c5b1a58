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

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from . import devices, nbtools
from .paged import kernels
from .timing import check_int, resolve_device, time_fn
from .units import GiB, KiB, MiB, fmt_bytes

__all__ = [
    "GPU_SIZES", "CPU_SIZES",
    "available_paths", "valid_paths", "resolve_paths", "parse_size", "resolve_sizes", "auto_copies", "measure",
]

#: 4 KiB … 1 GiB in powers of 4 (10 sizes): the GPU sweep.
GPU_SIZES: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(10))
#: 4 KiB … 16 MiB in powers of 4 (7 sizes): a CPU sweep that runs in about a second.
CPU_SIZES: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(7))

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
                if dev.type != "cuda" and q.split(":")[0] in ("d2d_same", "d2d_same_sm", "d2h_pinned", "h2d_pinned",
                                                              "d2h_pageable", "d2d_peer", "d2d_peer_sm"):
                    raise ValueError(f"path {q!r} needs a CUDA GPU and torch sees none here; on this machine: {valid}")
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
    interactive = nbtools.is_interactive()
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

    n = check_int("n", n, 1)
    warmup = check_int("warmup", warmup, 0)
    if not (isinstance(copies, str) and copies == "auto"):
        copies = check_int("copies", copies, 1)
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
