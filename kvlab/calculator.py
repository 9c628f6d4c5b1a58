"""The KV-cache bill as arithmetic: bytes, prefill FLOPs, link time, tensor parallelism, the whole handoff.

Pure Python (no torch, no numpy), so it imports instantly and every number can be checked by hand.
Conventions:

* sizes are bytes (``int``); ``KiB``/``MiB``/``GiB`` are powers of 1024, link speeds are decimal
  (``Gb/s`` = 1e9 bits/s, ``GB/s`` = 1e9 bytes/s), as NICs and NVLink are quoted;
* times are seconds (``_s``) unless a name says ``_us`` (microseconds) or ``_ms``;
* FLOPs count a multiply-add as 2;
* ``tokens`` is the prompt length of one sequence (batch 1).

Models are :class:`kvlab.models.ModelSpec` or a registry name (``"llama-3.1-8b"``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any

from kvlab import models as _models
from kvlab.exposure import Exposure, pipeline_exposure
from kvlab.units import fmt_bytes  # part of this module's interface: calculator.fmt_bytes

__all__ = [
    "DTYPE_BYTES",
    "dtype_bytes",
    "kv_bytes_per_token",
    "kv_layer_bytes",
    "kv_cache_bytes",
    "recurrent_state_bytes",
    "state_layer_bytes",
    "cache_bytes",
    "attended_pairs",
    "PrefillFlops",
    "prefill_flops",
    "Link",
    "LINKS",
    "link",
    "transfer_time_s",
    "TPShard",
    "tp_shard_bytes",
    "tp_transfer_time_s",
    "HandoffEstimate",
    "handoff_estimate",
    "fmt_bytes",
]


# Bytes per stored KV element. fp8 variants differ in range/precision, not in size.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
    "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
}


def dtype_bytes(kv_dtype: Any) -> int:
    """Bytes per element of a KV dtype: ``"bf16"`` → 2, ``"fp8"`` → 1, ….

    Accepts the keys of :data:`DTYPE_BYTES`, long names (``"bfloat16"``) and torch dtypes
    (``torch.float8_e4m3fn``, matched by name so torch is not imported). Unknown → ValueError.
    """
    key = str(kv_dtype).lower().removeprefix("torch.").replace("-", "_")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not known; valid: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def _spec(model: Any) -> _models.ModelSpec:
    return model if isinstance(model, _models.ModelSpec) else _models.get(model)


# numbers.Integral / numbers.Real also admit numpy scalars (values read back from a DataFrame);
# bool is excluded on purpose: True is an int to Python but never a token count.
def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer ≥ 1")
    return int(value)


def _positive_float(name: str, value: Any) -> float:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite number > 0")
    return float(value)


# ---- bytes ------------------------------------------------------------------------------------


def kv_bytes_per_token(model: Any, kv_dtype: Any = "bf16") -> int:
    """KV bytes one token adds to the cache, summed over the attention layers (no sliding-window cap).

    Standard attention: ``attention layers · 2 (K and V) · kv_heads · head_dim · bytes``.
    MLA: ``layers · (kv_lora_rank + qk_rope_head_dim) · bytes`` — one compressed latent and the
    shared RoPE key, not separate K and V. ``llama-2-7b`` in bf16: 32·2·32·128·2 = 524288.
    A hybrid's state layers add nothing per token (:func:`recurrent_state_bytes` is their fixed state), and a
    sliding layer stops adding once its window is full: at a prompt's length the bytes per token are
    ``kv_cache_bytes(model, tokens) / tokens``, which can be much less.
    """
    spec = _spec(model)
    return len(spec.attention_layers) * spec.kv_elements_per_token_layer * dtype_bytes(kv_dtype)


def kv_layer_bytes(model: Any, tokens: int, kv_dtype: Any = "bf16") -> list[int]:
    """KV bytes held by each layer after ``tokens`` tokens, as a list of ``layers`` ints.

    A sliding-window layer holds ``min(tokens, sliding_window)`` tokens; a hybrid's state layers hold none (0);
    the others hold all.
    """
    spec = _spec(model)
    tokens = _positive_int("tokens", tokens)
    per_token = spec.kv_elements_per_token_layer * dtype_bytes(kv_dtype)
    state = set(spec.state_layers)
    held = [0 if i in state else min(tokens, spec.sliding_window) if spec.is_sliding(i) else tokens
            for i in range(spec.layers)]
    return [per_token * t for t in held]


def kv_cache_bytes(model: Any, tokens: int, kv_dtype: Any = "bf16") -> int:
    """Total KV bytes of one ``tokens``-long sequence: the sum of :func:`kv_layer_bytes`."""
    return sum(kv_layer_bytes(model, tokens, kv_dtype))


def recurrent_state_bytes(model: Any, conv_dtype: Any = "bf16", state_dtype: Any = "fp32") -> int:
    """Bytes of the fixed state one sequence keeps in a hybrid's linear-attention or state-space layers, whatever
    its length (0 for a transformer): per state layer a convolution window (``spec.conv_state``) and a recurrent
    state (``spec.recurrent_state``). Defaults as transformers keeps them: the window in the model's dtype
    (bf16), the recurrent state in fp32. Serving engines may keep both in bf16 (vLLM's ``mamba_ssm_cache_dtype``
    auto): pass ``state_dtype="bf16"``. This state crosses the wire with the KV, once per sequence.
    """
    return sum(state_layer_bytes(model, conv_dtype, state_dtype))


def state_layer_bytes(model: Any, conv_dtype: Any = "bf16", state_dtype: Any = "fp32") -> list[int]:
    """Each layer's share of :func:`recurrent_state_bytes`, as a list of ``layers`` ints (0 on attention layers)."""
    spec = _spec(model)
    per = (math.prod(spec.conv_state) * dtype_bytes(conv_dtype) if spec.conv_state else 0) + \
        (math.prod(spec.recurrent_state) * dtype_bytes(state_dtype) if spec.recurrent_state else 0)
    state = set(spec.state_layers)
    return [per if i in state else 0 for i in range(spec.layers)]


def cache_bytes(model: Any, tokens: int, kv_dtype: Any = "bf16", conv_dtype: Any = "bf16",
                state_dtype: Any = "fp32") -> int:
    """Everything one ``tokens``-long sequence's decode needs from prefill: its KV (:func:`kv_cache_bytes`) plus a
    hybrid's per-sequence state (:func:`recurrent_state_bytes`)."""
    return kv_cache_bytes(model, tokens, kv_dtype) + recurrent_state_bytes(model, conv_dtype, state_dtype)


# ---- FLOPs ------------------------------------------------------------------------------------


def attended_pairs(tokens: int, window: int | None = None) -> int:
    """(query, key) pairs a causal prefill scores: Σ_{i=1..T} min(i, W).

    Full causal attention: T(T+1)/2 (each query sees itself and everything before it). With a
    window W < T: W(W+1)/2 for the first W queries plus W for each of the remaining T − W.
    """
    tokens = _positive_int("tokens", tokens)
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    window = _positive_int("window", window)
    return window * (window + 1) // 2 + (tokens - window) * window


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of one prefill pass over ``tokens`` tokens (a multiply-add = 2 FLOPs).

    Fields:
        tokens: prompt length.
        dense: ``2 · active_params · tokens`` — every weight multiplies every token once
            (embedding lookup included, as the usual approximation does).
        attention: the score (QKᵀ) and mix (AV) products, summed over layers.
        attention_per_layer: the attention term of each layer (sliding layers are smaller).
        total: ``dense + attention``.
    """

    tokens: int
    dense: float
    attention: float
    attention_per_layer: tuple[float, ...]
    total: float

    def per_layer(self) -> list[float]:
        """FLOPs per layer: an equal share of the dense term plus that layer's attention term.

        Sums to :attr:`total`; used to split a prefill time over layers.
        """
        n = len(self.attention_per_layer)
        return [self.dense / n + a for a in self.attention_per_layer]

    @property
    def attention_fraction(self) -> float:
        """Share of the total that is attention (grows with tokens: the quadratic term)."""
        return self.attention / self.total


def prefill_flops(model: Any, tokens: int) -> PrefillFlops:
    """Prefill FLOPs: dense matmuls plus causal attention.

    Formula, per layer with ``P`` = :func:`attended_pairs` (``T(T+1)/2``, window-capped on
    sliding layers): ``2 · heads · (d_qk + d_v) · P`` — a QKᵀ dot product of width ``d_qk`` and
    an AV accumulation of width ``d_v`` per (query, key) pair per head. Standard attention:
    ``d_qk = d_v = head_dim``, i.e. about ``2·2·heads·head_dim·T²/2`` per layer. MLA: prefill
    runs in the expanded form (the latent is up-projected to per-head keys and values, as
    DeepSeek's inference code does for prefill), so ``d_qk = qk_nope + qk_rope`` (192 for
    DeepSeek-V3) and ``d_v = v_head_dim`` (128); the up-projections are weights and so already
    in the dense term. Softmax, norms and RoPE are ignored (a few FLOPs per element). A hybrid's state layers
    have no quadratic term (0 here): their scan costs a few FLOPs per state element per token, linear in the
    prompt and small beside their projections, which the dense term counts.
    """
    spec = _spec(model)
    tokens = _positive_int("tokens", tokens)
    dense = 2.0 * spec.active_params * tokens
    width = spec.head_dim + spec.v_head_dim
    full = attended_pairs(tokens)
    windowed = attended_pairs(tokens, spec.sliding_window) if spec.sliding_window else full
    state = set(spec.state_layers)
    per_layer = tuple(0.0 if i in state else 2.0 * spec.heads * width * (windowed if spec.is_sliding(i) else full)
                      for i in range(spec.layers))
    attention = sum(per_layer)
    return PrefillFlops(tokens=tokens, dense=dense, attention=attention,
                        attention_per_layer=per_layer, total=dense + attention)


# ---- links ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """A one-directional path between a prefill and a decode GPU.

    Fields:
        name: label for tables (``"400G"``).
        bytes_per_s: nominal bandwidth, bytes per second (decimal: 400 Gb/s → 50e9).
        efficiency: achieved fraction of nominal, in (0, 1] (protocol overheads, small messages).
        fixed_us: fixed cost per copy/RDMA write, microseconds (launch, doorbell, completion);
            seed 004 measured about 18 µs per ``copy_`` over NVLink.
    """

    name: str
    bytes_per_s: float
    efficiency: float = 1.0
    fixed_us: float = 0.0

    def __post_init__(self) -> None:
        _positive_float(f"link {self.name!r} bytes_per_s", self.bytes_per_s)
        eff = self.efficiency
        if not _is_real(eff) or not 0 < eff <= 1:
            raise ValueError(f"link {self.name!r} efficiency={eff!r}: must be in (0, 1]")
        fx = self.fixed_us
        if not _is_real(fx) or not math.isfinite(fx) or fx < 0:
            raise ValueError(f"link {self.name!r} fixed_us={fx!r}: must be a finite number ≥ 0")

    @classmethod
    def from_gbps(cls, gbit_per_s: float, name: str | None = None, efficiency: float = 1.0,
                  fixed_us: float = 0.0) -> Link:
        """A link quoted in gigabits per second (NICs: ``400`` → 50e9 bytes/s)."""
        g = _positive_float("gbit_per_s", gbit_per_s)
        return cls(name or f"{g:g} Gb/s", g * 1e9 / 8, efficiency, fixed_us)

    @classmethod
    def from_GBps(cls, gbyte_per_s: float, name: str | None = None, efficiency: float = 1.0,
                  fixed_us: float = 0.0) -> Link:
        """A link quoted in gigabytes per second (NVLink, PCIe: ``450`` → 450e9 bytes/s)."""
        g = _positive_float("gbyte_per_s", gbyte_per_s)
        return cls(name or f"{g:g} GB/s", g * 1e9, efficiency, fixed_us)

    @property
    def effective_bytes_per_s(self) -> float:
        """Bandwidth a large copy achieves: ``bytes_per_s · efficiency``."""
        return self.bytes_per_s * self.efficiency

    @property
    def gbit_per_s(self) -> float:
        """Nominal bandwidth in Gb/s (decimal)."""
        return self.bytes_per_s * 8 / 1e9

    @property
    def gbyte_per_s(self) -> float:
        """Nominal bandwidth in GB/s (decimal)."""
        return self.bytes_per_s / 1e9

    def with_(self, **changes: Any) -> Link:
        """A copy with some fields changed, e.g. ``LINKS["400G"].with_(efficiency=0.8)``."""
        return dataclasses.replace(self, **changes)


# Nominal, per direction. Seed 000 uses the NIC rates; seed 004 supplies the NVLink figures.
LINKS: dict[str, Link] = {
    "100G": Link.from_gbps(100, "100G"),
    "200G": Link.from_gbps(200, "200G"),
    "400G": Link.from_gbps(400, "400G"),
    "800G": Link.from_gbps(800, "800G"),
    # H100 SXM NVLink 4: 900 GB/s bidirectional, 450 GB/s each way.
    "nvlink-h100": Link.from_GBps(450, "nvlink-h100"),
    # Seed 004's 2×H100 measurement: 395 GB/s for a 1 GiB peer copy, ~18 µs per copy.
    "nvlink-h100-measured": Link.from_GBps(395, "nvlink-h100-measured", fixed_us=18.0),
    # PCIe 5.0 x16: 32 GT/s × 16 lanes × 128/130 ≈ 63 GB/s each way; quoted as ~64.
    "pcie5-x16": Link.from_GBps(64, "pcie5-x16"),
}

# Short spellings people type for the presets.
_LINK_ALIASES = {"nvlink": "nvlink-h100", "nvlink4": "nvlink-h100", "pcie5": "pcie5-x16",
                 "pcie": "pcie5-x16", "nvlink-measured": "nvlink-h100-measured"}

_UNIT_BITS = {"": 1e9, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_LINK_RE = re.compile(
    r"^\s*(?P<num>[-+]?\d+(?:\.\d*)?(?:e[+-]?\d+)?|[-+]?\.\d+)\s*(?P<prefix>[kKmMgGtT]?)"
    r"(?P<unit>bit/s|bits/s|b/s|bps|B/s|Bps|byte/s|bytes/s|b|B)?\s*$")


def link(x: Any) -> Link:
    """Parse a link: a :class:`Link`, a preset name, a rate string, or a bare number (Gb/s).

    Accepted: preset names (:data:`LINKS`, case-insensitive: ``"400G"``, ``"nvlink-h100"``; also
    ``"nvlink"`` and ``"pcie5"``);
    ``"400Gb/s"``, ``"400 Gbps"``, ``"400G"`` (bits — lower-case ``b`` or no unit, as NICs are
    quoted); ``"50GB/s"``, ``"50 GBps"`` (bytes — upper-case ``B``); prefixes k, M, G, T;
    numbers and numeric strings are Gb/s (``400`` == ``"400G"``). Rates ≤ 0 → ValueError.
    """
    if isinstance(x, Link):
        return x
    if isinstance(x, bool):
        raise ValueError(f"link={x!r} is not a link rate")
    if _is_real(x):
        return Link.from_gbps(_positive_float("link rate (Gb/s)", x), f"{float(x):g}G")
    if not isinstance(x, str):
        raise ValueError(f"link={x!r}: expected a Link, a preset name, a rate such as '400Gb/s' "
                         "or '50GB/s', or a number of Gb/s")
    key = x.strip().lower()
    key = _LINK_ALIASES.get(key, key)
    for name, preset in LINKS.items():
        if name.lower() == key:
            return preset
    m = _LINK_RE.match(x)
    if not m:
        raise ValueError(f"link={x!r} is not understood; presets: {', '.join(LINKS)}; or a rate "
                         "such as '400Gb/s', '400G', '50GB/s', '1.6Tb/s', or a number of Gb/s")
    value = float(m["num"])
    if value <= 0:
        raise ValueError(f"link={x!r}: a rate must be > 0")
    scale = _UNIT_BITS[m["prefix"].lower()] if m["prefix"] else 1e9
    unit = m["unit"] or ""
    is_bytes = unit.startswith("B")
    rate = value * scale if is_bytes else value * scale / 8
    return Link(x.strip(), rate)


def transfer_time_s(nbytes: float, link_: Any, copies: int = 1) -> float:
    """Seconds to move ``nbytes`` over a link in ``copies`` separate copies.

    ``copies · fixed_us · 1e-6 + nbytes / (bytes_per_s · efficiency)``. ``copies`` counts the
    separate transfers that each pay the fixed cost (e.g. 56 for K and V of 28 layers sent one
    tensor at a time). ``nbytes`` ≥ 0, ``copies`` ≥ 1.
    """
    lk = link(link_)
    if not _is_real(nbytes) or not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r}: must be a finite number ≥ 0")
    copies = _positive_int("copies", copies)
    return copies * lk.fixed_us * 1e-6 + nbytes / lk.effective_bytes_per_s


# ---- tensor parallelism -----------------------------------------------------------------------


@dataclass(frozen=True)
class TPShard:
    """What each GPU of a TP group holds (and sends) of one sequence's KV cache.

    Fields:
        tp: tensor-parallel degree (GPUs, each with its own NIC on a rail-optimised fabric).
        tokens, kv_dtype: the sequence and element type.
        bytes_per_gpu: KV bytes on (and sent by) each GPU.
        unique_bytes: the model's KV bytes without replicas (:func:`kv_cache_bytes`).
        total_bytes: ``bytes_per_gpu · tp`` — what all GPUs send together, replicas included.
        kv_heads_per_gpu: KV heads each GPU holds (1 once tp ≥ kv_heads; MLA: the one latent).
        replication: copies of each KV head across the group: 1 while tp ≤ kv_heads, then
            ``tp / kv_heads``; MLA: ``tp`` (the latent is not split by heads).
        replicated: ``replication > 1`` — adding GPUs no longer shrinks each GPU's share.
        query_heads_split: whether ``heads`` divides by ``tp`` (serving engines require it).
        note: a sentence for tables saying what happened.
    """

    tp: int
    tokens: int
    kv_dtype: str
    bytes_per_gpu: int
    unique_bytes: int
    total_bytes: int
    kv_heads_per_gpu: int
    replication: int
    replicated: bool
    query_heads_split: bool
    note: str


def _valid_tp(spec: _models.ModelSpec, limit: int = 64) -> list[int]:
    kv = spec.kv_heads
    return [t for t in range(1, limit + 1)
            if (t <= kv and kv % t == 0) or (t > kv and t % kv == 0)]


def tp_shard_bytes(model: Any, tokens: int, tp: int, kv_dtype: Any = "bf16") -> TPShard:
    """Each GPU's KV share under tensor parallelism ``tp``.

    KV heads are split across GPUs: each holds ``kv_heads / tp`` heads while ``tp ≤ kv_heads``
    (which must divide evenly). Beyond that each GPU still needs one whole KV head for its query
    heads, so every head is replicated ``tp / kv_heads`` times (``tp`` must then be a multiple
    of ``kv_heads``) and per-GPU bytes stop shrinking — the replication knee.

    MLA (DeepSeek): the cached latent is shared by all heads and is not split; every TP rank
    holds (and here sends) the whole latent, so per-GPU bytes never shrink with TP. This models
    rank i of prefill sending to rank i of decode; schemes that send 1/tp of the latent and
    all-gather on the decode side are not modelled.
    """
    spec = _spec(model)
    tp = _positive_int("tp", tp)
    tokens = _positive_int("tokens", tokens)
    unique = kv_cache_bytes(spec, tokens, kv_dtype)
    dt = str(kv_dtype)
    heads_split = spec.heads % tp == 0
    if spec.attention == "mla":
        note = (f"MLA latent is not split by heads: each of {tp} GPU(s) holds all of it"
                if tp > 1 else "one GPU holds the whole latent cache")
        return TPShard(tp, tokens, dt, unique, unique, unique * tp, 1, tp, tp > 1, heads_split,
                       note)
    kv = spec.kv_heads
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        raise ValueError(f"tp={tp} does not split {spec.name}'s {kv} KV heads evenly; valid tp: "
                         f"{', '.join(map(str, _valid_tp(spec)))}")
    heads_per_gpu = max(kv // tp, 1)
    replication = max(tp // kv, 1)
    # Integer arithmetic: the per-layer byte counts are multiples of kv_heads.
    per_gpu = unique * heads_per_gpu // kv
    if replication > 1:
        note = (f"tp={tp} > {kv} KV heads: each head is replicated {replication}×, per-GPU bytes "
                f"stay at one head's share")
    else:
        note = f"{heads_per_gpu} of {kv} KV heads per GPU"
    if not heads_split:
        note += f"; {spec.heads} query heads do not split over {tp} GPUs (engines refuse this tp)"
    return TPShard(tp, tokens, dt, per_gpu, unique, per_gpu * tp, heads_per_gpu, replication,
                   replication > 1, heads_split, note)


def tp_transfer_time_s(model: Any, tokens: int, link_: Any, tp: int = 1, kv_dtype: Any = "bf16",
                       copies: int = 1) -> float:
    """Seconds to hand one sequence's KV to decode when each of ``tp`` GPUs sends its shard over
    its own NIC (a rail-optimised fabric: GPU i of every node on the same leaf), in parallel.

    = :func:`transfer_time_s` of :attr:`TPShard.bytes_per_gpu` (plus ``1/tp`` of a hybrid's
    :func:`recurrent_state_bytes`, as :func:`handoff_estimate` sends it) over one ``link_``; ``copies``
    separate copies per GPU.
    """
    shard = tp_shard_bytes(model, tokens, tp, kv_dtype)
    return transfer_time_s(shard.bytes_per_gpu + recurrent_state_bytes(model) / shard.tp, link_, copies)


# ---- the whole handoff ------------------------------------------------------------------------


@dataclass(frozen=True)
class HandoffEstimate:
    """One prompt's prefill → decode handoff, estimated (seconds, bytes, FLOPs).

    Fields:
        model, tokens, kv_dtype, link, tp, tflops: the inputs (``link`` by name; ``tflops`` is
            achieved TFLOP/s per GPU).
        kv_bytes: the sequence's KV bytes (unique, no replicas).
        kv_bytes_per_gpu: what each TP rank sends over its own link (of the KV).
        state_bytes: a hybrid's per-sequence state (:func:`recurrent_state_bytes`, 0 for a transformer); each TP
            rank holds and sends ``1/tp`` of it (the state is split by heads or channels, as engines shard it) beside
            its KV, so the transfer times below include it.
        prefill_flops: total prefill FLOPs (dense + attention).
        prefill_s: ``prefill_flops / (tp · tflops · 1e12)`` — compute split evenly over the TP
            group (communication inside the group ignored).
        transfer_s: each rank's shard in one bulk copy over its link.
        ratio: ``transfer_s / prefill_s``.
        exposed_s: TTFT added by a layer-by-layer handoff (:func:`kvlab.exposure.pipeline_exposure`).
        bulk_exposed_s: TTFT added by sending everything after prefill (= ``transfer_s``).
        link_bound: the link fell behind compute at some layer.
        timeline: the per-layer :class:`Exposure`.
        shard: the :class:`TPShard` (replication flags and note).
    """

    model: str
    tokens: int
    kv_dtype: str
    link: str
    tp: int
    tflops: float
    kv_bytes: int
    kv_bytes_per_gpu: int
    state_bytes: int
    prefill_flops: float
    prefill_s: float
    transfer_s: float
    ratio: float
    exposed_s: float
    bulk_exposed_s: float
    link_bound: bool
    timeline: Exposure = field(repr=False)
    shard: TPShard = field(repr=False)

    @property
    def ttft_added_s(self) -> float:
        """Time-to-first-token added by the layer-wise handoff (= ``exposed_s``)."""
        return self.exposed_s

    def as_row(self) -> dict[str, Any]:
        """A flat dict for a tidy table (units in the keys)."""
        return {
            "model": self.model, "tokens": self.tokens, "kv_dtype": self.kv_dtype,
            "link": self.link, "tp": self.tp, "tflops": self.tflops,
            "kv_bytes": self.kv_bytes, "kv_bytes_per_gpu": self.kv_bytes_per_gpu, "state_bytes": self.state_bytes,
            "prefill_flops": self.prefill_flops, "prefill_ms": self.prefill_s * 1e3,
            "transfer_ms": self.transfer_s * 1e3, "ratio": self.ratio,
            "exposed_ms": self.exposed_s * 1e3, "bulk_exposed_ms": self.bulk_exposed_s * 1e3,
            "link_bound": self.link_bound, "kv_replication": self.shard.replication,
        }


def handoff_estimate(model: Any, tokens: int, link_: Any, kv_dtype: Any = "bf16", tp: int = 1,
                     tflops: float = 400.0) -> HandoffEstimate:
    """Bytes, prefill time, transfer time and exposed time of one prompt's handoff.

    Args:
        model: a ModelSpec or registry name.
        tokens: prompt length (tokens, ≥ 1).
        link_: anything :func:`link` accepts; each TP rank has one such link.
        kv_dtype: KV element type (``"bf16"``, ``"fp8"`` …).
        tp: tensor-parallel degree of the prefill instance (≥ 1).
        tflops: achieved dense TFLOP/s per GPU (default 400: about 40 % of an H100's bf16 peak).

    Per-layer compute time is the prefill time split by each layer's share of FLOPs
    (:meth:`PrefillFlops.per_layer`: equal dense shares plus that layer's attention); per-layer
    transfer time is that layer's share of the GPU's KV bytes over the link, one copy per layer
    (K and V of a layer are contiguous in kvlab's buffer layout), paying the link's fixed cost. A hybrid's state
    layers send their state (``1/tp`` of it per rank) in place of KV, in transformers' dtypes
    (:func:`recurrent_state_bytes`).
    """
    spec = _spec(model)
    lk = link(link_)
    tflops = _positive_float("tflops", tflops)
    shard = tp_shard_bytes(spec, tokens, tp, kv_dtype)
    fl = prefill_flops(spec, tokens)
    rate = tp * tflops * 1e12
    compute = [f / rate for f in fl.per_layer()]
    frac = shard.bytes_per_gpu / shard.unique_bytes
    state = state_layer_bytes(spec)
    layer_bytes = [b * frac + st / shard.tp for b, st in zip(kv_layer_bytes(spec, tokens, kv_dtype), state)]
    transfer = [transfer_time_s(b, lk) for b in layer_bytes]
    timeline = pipeline_exposure(compute, transfer)
    prefill_s = fl.total / rate
    bulk = transfer_time_s(shard.bytes_per_gpu + sum(state) / shard.tp, lk)
    return HandoffEstimate(
        model=spec.name, tokens=shard.tokens, kv_dtype=str(kv_dtype), link=lk.name, tp=shard.tp,
        tflops=tflops, kv_bytes=shard.unique_bytes, kv_bytes_per_gpu=shard.bytes_per_gpu, state_bytes=sum(state),
        prefill_flops=fl.total, prefill_s=prefill_s, transfer_s=bulk, ratio=bulk / prefill_s,
        exposed_s=timeline.exposed_s, bulk_exposed_s=bulk, link_bound=timeline.link_bound,
        timeline=timeline, shard=shard)
