"""What a `kvlab disagg` run does, and every check of it made before a process starts or a folder is written."""

from __future__ import annotations

import dataclasses
import os

from .. import devices, models
from ..parse import name_list, suggest, token_list
from .backends import BACKENDS, backend
from .faults import KINDS, POLICIES
from .nixl_link import DESCS
from .wire_codec import check_wire

__all__ = ["DisaggConfig", "MODES", "LAYOUTS", "KV_DTYPES", "check", "is_default", "kv_dtype_name", "norm_device",
           "DECODE", "PREFILL", "from_params"]

MODES = ("bulk", "layerwise")
LAYOUTS = ("contiguous", "paged")
KV_DTYPES = ("bfloat16", "float16", "float32")
BLOCK_ORDERS = ("random", "packed")
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

DECODE, PREFILL = 0, 1  # ranks: the decode process is rank 0 (it writes the run), the prefill process rank 1


@dataclasses.dataclass
class DisaggConfig:
    """One two-process run. Every (layout, context) pair is measured with every mode, interleaved round by
    round with a colocated prefill (the prefill process prefilling and sending nothing).

    backend: gloo | ipc | nccl | nixl (kvlab.disagg.backends; what this machine lacks: `Backend.unavailable`); model: registry name or config path;
    weights: "random" (seeded, identical in both processes) or a local checkpoint; contexts: prompt tokens;
    modes: bulk and/or layerwise; layouts: contiguous and/or paged (block_size tokens a block);
    kv_dtype: the model's and cache's dtype; device / decode_device: "auto", "cpu" or "cuda:N" (auto: cuda:0
    for prefill; decode on cuda:1 for nccl, else on the prefill device); repeats / warmup: timed and untimed
    rounds; decode_tokens: greedy tokens compared with the colocated decode; timeout_s: the deadline of every
    wait across the boundary; bench: also time the bulk send alone beside an in-process copy of the same
    bytes (ipc, nccl, gloo), bench_repeats times; port: the control store's port (0: a free one); drop_layer: a fault for
    tests — the prefill side never sends this layer in layer-wise mode (-1: none).
    """

    backend: str = "gloo"
    model: str = "kvlab-tiny"
    weights: str = "random"
    contexts: tuple = (128,)
    modes: tuple = ("bulk", "layerwise")
    layouts: tuple = ("contiguous",)
    block_size: int = 16
    kv_dtype: str = "bfloat16"
    device: str = "auto"
    decode_device: str = "auto"
    repeats: int = 3
    warmup: int = 1
    decode_tokens: int = 20
    timeout_s: float = 120.0
    bench: bool = False
    bench_repeats: int = 15
    seed: int = 0
    port: int = 0
    drop_layer: int = -1
    threads: int = 0  # torch threads per process on a CPU (0: half the cores each, at least 1)
    faults: int = 0  # a fault-injection campaign of this many requests on the first layout and context
    policy: str = "fail"  # what the decode side does about a fault: fail, retry, recompute (kvlab.disagg.faults)
    retries: int = 2  # retry: attempts after the first
    fault_timeout_s: float = 1.0  # the campaign's deadline for a layer to land
    fault_kinds: tuple = ("drop", "delay", "corrupt")  # the campaign's kinds, in turn (also kill: gloo only; oom)
    nixl_descs: str = "block"  # nixl, paged: one descriptor per block ("block") or per run of adjacent blocks ("merged")
    block_order: str = "random"  # paged: how both sides' allocators hand out blocks, "random" (a busy server's
    # scattered free list) or "packed" (the lowest free ids in order: a fresh server, blocks adjacent)
    decode_memory_gib: float = 0.0  # cap on the decode process's allocator while it serves (0: none)
    in_order: bool = False  # gloo: match sends to receives in order, as NCCL does (every unit tag 0), so NCCL's
    # fault protocol (a dropped layer holds back the layers behind it) runs on a CPU
    wire_dtype: str = "bf16"  # what crosses: the cache as it is (bf16), or FP8 with its scales (kvlab.disagg.wire_codec)
    wire_scales: str = "per-token-head"  # fp8: per-token-head (dynamic), per-head or per-tensor (from the request)
    prefill_tp: int = 1  # prefill ranks, each its own process holding its KV-head shard (kvlab.disagg.tp_handoff)
    decode_tp: int = 1  # decode ranks, each its own process, decoding together with TP

    def spec(self):
        """The model's ModelSpec: a registry name's, or read from the config.json / model folder `model` names."""
        return models.from_hf_config(self.model) if os.path.exists(self.model) else models.get(self.model)

    def devices(self) -> tuple[str, str]:
        """(prefill device, decode device) with "auto" resolved."""
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pre = self.device if self.device != "auto" else ("cuda:0" if n else "cpu")
        if self.decode_device != "auto":
            dec = self.decode_device
        elif BACKENDS[self.backend].decode_gpu:
            dec = f"cuda:{BACKENDS[self.backend].decode_gpu}"
        else:
            dec = pre
        return norm_device(pre), norm_device(dec)


def norm_device(d: str) -> str:
    """"cuda" as the first GPU, "cuda:0"; any other name as given."""
    return "cuda:0" if d == "cuda" else d


def kv_dtype_name(value, what: str = "kv_dtype") -> str:
    """The canonical name of a model and cache dtype ("bfloat16", "float16", "float32") from any spelling users type
    (bf16, fp16, half, fp32, float, torch.bfloat16); ValueError naming the value otherwise."""
    dt = str(value).lower().removeprefix("torch.")
    dt = _DTYPE_ALIASES.get(dt, dt)
    if dt not in KV_DTYPES:
        raise ValueError(f"{what} = {value!r} is not valid; valid: {', '.join(KV_DTYPES)} (or bf16, fp16, fp32): "
                         "the model runs in this dtype, so its cache is this dtype")
    return dt


def _device_ok(name: str, what: str) -> None:
    import torch

    if name == "cpu":
        return
    if not name.startswith("cuda"):
        raise ValueError(f"{what} = {name!r} is not a device; give 'auto', 'cpu' or 'cuda:N'")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{what} = {name!r} is not a device; give 'auto', 'cpu' or 'cuda:N'") from None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (dev.index or 0) >= n:
        raise ValueError(f"{what} = {name!r} does not exist: this machine has {n} GPU(s)"
                         + (f" (cuda:0 … cuda:{n - 1})" if n else ""))


_MAX_BLOCK = 4096  # tokens a block: past it a pool is mostly padding (1,000,000 made 244 MiB of a 12 KiB cache)
_MAX_WAIT_S = 86400.0  # a deadline longer than a day is a typo (and past what the control store's timer takes)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DisaggConfig)}
_MAX_DECODE_TOKENS = 4096  # a correctness check decodes 20; thousands more only take time


def _differs(value, default) -> bool:
    if isinstance(default, tuple):
        try:
            return tuple(name_list(value, "value")) != default
        except ValueError:
            return True
    return value != default


def is_default(cfg: DisaggConfig, name: str) -> bool:
    """Is option `name` of `cfg` still its default (a list option compared as its names, "a,b" = ("a", "b"))?"""
    return not _differs(getattr(cfg, name), _DEFAULTS[name])


def check(cfg: DisaggConfig) -> DisaggConfig:
    """Every value of `cfg` checked and normalised (lists from text, dtype aliases); ValueError naming the bad
    value and what would be valid. Nothing is started or written."""
    b = backend(cfg.backend)
    cfg.model = models.kv_model_ref(cfg.model, "model")
    models.check_weights(cfg.weights, "weights")
    cfg.contexts = tuple(token_list(cfg.contexts, "context", 1))
    if len(set(cfg.contexts)) != len(cfg.contexts):
        raise ValueError(f"context lists {list(cfg.contexts)} with a repeat; give each once")
    cfg.modes = tuple(name_list(cfg.modes, "mode"))
    cfg.layouts = tuple(name_list(cfg.layouts, "layout"))
    for what, items, valid in (("mode", cfg.modes, MODES), ("layout", cfg.layouts, LAYOUTS)):
        for v in items:
            if v not in valid:
                raise ValueError(f"{what} = {v!r} is not valid; valid: {', '.join(valid)}{suggest(v, valid)}")
        if len(set(items)) != len(items):
            raise ValueError(f"{what} lists {list(items)} with a repeat; give each once")
    cfg.kv_dtype = kv_dtype_name(cfg.kv_dtype)
    # every count between a floor and a ceiling: past the ceiling is a typing mistake that would otherwise fail in the
    # workers, after the run folder exists (a seed past 2**32 - 1 is refused by numpy's generators there)
    for name, low, high in (("block_size", 1, None), ("repeats", 1, 10_000_000), ("warmup", 0, 10_000),
                            ("decode_tokens", 1, _MAX_DECODE_TOKENS), ("bench_repeats", 3, 100_000),
                            ("seed", 0, 2**32 - 1), ("threads", 0, 4096), ("prefill_tp", 1, 64), ("decode_tp", 1, 64)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
            raise ValueError(f"{name.replace('_', '-')} = {v!r}: give an int ≥ {low}"
                             + (f" and ≤ {high:,}" if high is not None else ""))
    if not isinstance(cfg.port, int) or not 0 <= cfg.port <= 65535:
        raise ValueError(f"port = {cfg.port!r}: give 0 (a free port) or 1 … 65535")
    for what, v in (("timeout", cfg.timeout_s), ("fault-timeout", cfg.fault_timeout_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= _MAX_WAIT_S:
            raise ValueError(f"{what} = {v!r}: give seconds > 0 and at most {_MAX_WAIT_S:g} (a day)")
    longest = max(cfg.contexts)
    spec = cfg.spec()
    if cfg.weights == "random" and spec.max_positions and longest > spec.max_positions:  # a checkpoint: its own
        raise ValueError(f"context = {longest}: longer than {cfg.model}'s {spec.max_positions} positions "
                         "(max_position_embeddings); give at most that")
    if "paged" in cfg.layouts and cfg.block_size > _MAX_BLOCK:  # one partial block is fine; a million-token one
        raise ValueError(f"block-size = {cfg.block_size}: give at most {_MAX_BLOCK} tokens a block (serving engines "
                         "use 16 to 256)")
    for what, d in (("device", cfg.device), ("decode-device", cfg.decode_device)):
        if d != "auto":
            _device_ok(norm_device(str(d)), what)
    if not isinstance(cfg.in_order, bool):
        raise ValueError(f"in_order = {cfg.in_order!r}: give True or False")
    if cfg.in_order and not b.can_in_order:
        raise ValueError(f"in-order makes gloo match sends in order as nccl does; got backend {cfg.backend!r} "
                         + (f"({cfg.backend} is in order already)" if b.in_order
                            else "(it has no receives to match: ipc and nixl write into the destination)")
                         + ": leave --in-order out")
    if cfg.drop_layer >= 0 and (b.in_order or cfg.in_order):
        raise ValueError(f"drop_layer = {cfg.drop_layer} on an in-order link ({cfg.backend}"
                         f"{', in order' if cfg.in_order else ''}): the next layer's bytes would land in the skipped "
                         "layer's receive, and the last receive would take the next request's first send; run a "
                         "fault campaign (--faults N --fault-kinds drop), which holds the later layers back")
    pre, dec = cfg.devices()
    why = b.unavailable(pre, dec, "paged" in cfg.layouts)
    if why:
        raise ValueError(why)
    if cfg.policy not in POLICIES:
        raise ValueError(f"policy = {cfg.policy!r} is not valid; valid: {', '.join(POLICIES)}"
                         f"{suggest(cfg.policy, POLICIES)}")
    for name in ("faults", "retries"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} = {v!r}: give an int ≥ 0")
    if cfg.nixl_descs not in DESCS:
        raise ValueError(f"nixl-descs = {cfg.nixl_descs!r} is not valid; valid: {', '.join(DESCS)}")
    if cfg.block_order not in BLOCK_ORDERS:
        raise ValueError(f"block-order = {cfg.block_order!r} is not valid; valid: {', '.join(BLOCK_ORDERS)}"
                         f"{suggest(cfg.block_order, BLOCK_ORDERS)}")
    if cfg.block_order != "random" and "paged" not in cfg.layouts:
        raise ValueError(f"block-order = {cfg.block_order!r} orders a paged cache's blocks; add --layout paged "
                         f"(layouts given: {', '.join(cfg.layouts)})")
    if cfg.nixl_descs != "block" and not b.descriptors:
        raise ValueError(f"nixl-descs = {cfg.nixl_descs!r} is an option of backend nixl; got backend {cfg.backend!r}")
    kinds = cfg.fault_kinds = tuple(name_list(cfg.fault_kinds, "fault-kinds"))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"fault-kinds = {','.join(kinds) or '(none)'}: valid kinds are {', '.join(KINDS)}"
                         f"{suggest(bad[0], KINDS) if bad else ''}")
    if not cfg.faults:  # the campaign's options, given without a campaign, would be ignored without a word
        given = [flag for flag, name in (("--policy", "policy"), ("--retries", "retries"),
                                         ("--fault-timeout", "fault_timeout_s"), ("--fault-kinds", "fault_kinds"))
                 if not is_default(cfg, name)]
        if given:
            raise ValueError(f"{', '.join(given)} set(s) up a fault campaign; add --faults N (N ≥ 1) or leave "
                             f"{'it' if len(given) == 1 else 'them'} out")
    if cfg.faults and "kill" in kinds and not b.can_kill:
        raise ValueError(f"fault-kinds: kill needs backend gloo (a new prefill process rejoins a new gloo group); "
                         f"got {cfg.backend!r}")
    if cfg.faults and cfg.fault_timeout_s + 1.0 >= cfg.timeout_s:
        raise ValueError(f"fault-timeout = {cfg.fault_timeout_s:g} s must stay at least 1 s under timeout = "
                         f"{cfg.timeout_s:g} s (a late layer is waited for after its deadline)")
    if cfg.bench and not b.can_bench:
        raise ValueError(f"bench times the send alone with backend "
                         f"{', '.join(n for n, x in BACKENDS.items() if x.can_bench)}; got {cfg.backend!r}")
    _wire_ok(cfg)
    _memory_cap_ok(cfg.decode_memory_gib, dec)
    if cfg.drop_layer >= spec.layers:
        raise ValueError(f"drop_layer = {cfg.drop_layer}: {spec.name} has layers 0 … {spec.layers - 1}")
    return cfg


# the backends an FP8 wire has run over (nccl needs two GPUs, which have not been lent since it was written)
WIRE_BACKENDS = ("gloo", "ipc", "nixl")


def _wire_ok(cfg: DisaggConfig) -> None:
    """--wire-dtype / --wire-scales: valid names, and an FP8 wire only where it has run — gloo (its sends are the
    tensors the wire makes), ipc and nixl (one-sided writes of the wire bytes into the decode side's staging
    tensor); not nccl, nor any backend between two GPUs, which have not run it — on a contiguous bf16 cache (a paged
    one over FP8: `kvlab wire`, notebook 07)."""
    check_wire(cfg.wire_dtype, cfg.wire_scales)
    if cfg.wire_dtype == "bf16":
        if not is_default(cfg, "wire_scales"):
            raise ValueError(f"wire-scales = {cfg.wire_scales!r} sets up an FP8 wire; add --wire-dtype fp8 or leave "
                             "it out")
        return
    if cfg.backend not in WIRE_BACKENDS:
        raise ValueError(f"wire-dtype = 'fp8' runs over backend {', '.join(WIRE_BACKENDS)} so far; got "
                         f"{cfg.backend!r} (nccl has not run it on two GPUs)")
    pre, dec = cfg.devices()
    if pre != dec and pre.startswith("cuda") and dec.startswith("cuda"):
        raise ValueError(f"wire-dtype = 'fp8' has run with both processes on one GPU or on CPUs so far; got {pre} → "
                         f"{dec} (not yet validated between two GPUs): give one device for both")
    if cfg.bench:
        raise ValueError("bench times the bf16 send against a plain copy of its bytes; with wire-dtype = 'fp8' the "
                         "send quantizes too: leave out --bench (notebook 07 times the FP8 kernels against the link)")
    if tuple(cfg.layouts) != ("contiguous",):
        raise ValueError(f"wire-dtype = 'fp8' moves a contiguous cache; got layout {','.join(cfg.layouts)}: give "
                         "--layout contiguous (a paged cache over FP8: kvlab wire, notebook 07)")
    if cfg.kv_dtype != "bfloat16":
        raise ValueError(f"wire-dtype = 'fp8' quantizes a bf16 cache; got kv-dtype {cfg.kv_dtype!r}: give "
                         "--kv-dtype bf16")


def _memory_cap_ok(gib, decode: str) -> None:
    """--decode-memory-gib: 0 (no cap), or GiB > 0 up to the decode GPU's memory."""
    import math

    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib < 0:
        raise ValueError(f"decode-memory-gib = {gib!r}: give GiB > 0, or 0 for no cap")
    if not gib:
        return
    if gib < 1 / 1024:
        raise ValueError(f"decode-memory-gib = {gib!r}: give at least 1 MiB (0.001 GiB), or 0 for no cap")
    if not decode.startswith("cuda"):
        raise ValueError(f"decode-memory-gib = {gib:g} caps a GPU's allocator; the decode device is {decode}: "
                         "leave it out, or decode on a GPU (--decode-device cuda:N)")
    import torch

    total = torch.cuda.get_device_properties(torch.device(decode)).total_memory / (1 << 30)
    if gib > total:
        raise ValueError(f"decode-memory-gib = {gib:g} is more than {decode} has ({total:.1f} GiB): give at most "
                         f"{total:.1f}, or 0 for no cap")


def from_params(params, gpu: bool | None = None) -> DisaggConfig:
    """The DisaggConfig of notebook 05's parameters, "auto" resolved by hardware (`gpu`; None: kvlab.devices.preset):
    backend ipc on a GPU, gloo on a CPU; Qwen2.5-7B at 1k…32k on a GPU, kvlab-tiny at 128 tokens on a CPU; the
    bench on for ipc and nccl on a GPU. Checked (`check`) before it is returned."""
    if gpu is None:
        gpu = devices.preset() == "gpu"
    p = dict(params)

    def auto(name, on_gpu, on_cpu):
        v = p.get(name, "auto")
        return (on_gpu if gpu else on_cpu) if v == "auto" else v

    backend = auto("backend", "ipc", "gloo")
    b = BACKENDS.get(backend)  # an unknown one is refused by check() below
    bench = auto("bench", "on" if b is not None and b.gpus else "off", "off")
    if bench not in ("on", "off"):
        raise ValueError(f"bench = {bench!r} is not valid; valid: auto, on, off")
    cfg = DisaggConfig(backend=backend, model=auto("model", "qwen2.5-7b", "kvlab-tiny"),
                       weights=p.get("weights", "random"), contexts=auto("contexts", "1k,4k,16k,32k", "128"),
                       modes=p.get("modes", "bulk,layerwise"), layouts=p.get("layouts", "contiguous,paged"),
                       block_size=p.get("block_size", 16), block_order=p.get("block_order", "random"),
                       kv_dtype=p.get("kv_dtype", "bf16"),
                       device=p.get("device", "auto"), decode_device=p.get("decode_device", "auto"),
                       repeats=p.get("repeats", 9), warmup=p.get("warmup", 2), decode_tokens=p.get("decode_tokens", 20),
                       timeout_s=p.get("timeout_s", 120.0), bench=bench == "on", faults=p.get("faults", 0),
                       policy=p.get("policy", "fail"))
    return check(cfg)
