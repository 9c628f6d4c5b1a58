"""What the fabric simulator is asked to run: the configuration (validated) and the requests it draws.

Every size comes from :mod:`kvlab.calculator`: a request of ``T`` prompt tokens needs
``prefill_flops(model, T).total / (tflops · 1e12)`` seconds of prefill, split over layers by each
layer's share of the FLOPs (``PrefillFlops.per_layer``), and hands ``kv_layer_bytes(model, T, kv_dtype)``
bytes per layer to decode (times ``fp8_factor`` with ``fp8``), plus a hybrid's state on its state layers
(``state_layer_bytes``, which an FP8 wire does not shrink).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlab import calculator, models
from kvlab.fabric.topology import TopologyConfig

__all__ = ["SENDS", "ARRIVALS", "PROMPTS", "DECODE_CHOICES", "PLACEMENTS", "LAYER_FLOWS",
           "SimConfig", "Workload", "draw"]

SENDS = ("bulk", "layerwise", "deadline")
ARRIVALS = ("poisson", "bursty")
PROMPTS = ("fixed", "uniform", "lognormal")
DECODE_CHOICES = ("round-robin", "least-loaded")
PLACEMENTS = ("split", "interleave")
LAYER_FLOWS = ("serial", "parallel")


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _int(name: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"{name}={v!r}: must be an integer ≥ {low}")


def _real(name: str, v: Any, low: float, strict: bool) -> None:
    if not _is_real(v) or (v <= low if strict else v < low):
        raise ValueError(f"{name}={v!r}: must be a finite number {'>' if strict else '≥'} {low:g}")


def _choice(name: str, v: Any, valid: tuple[str, ...]) -> None:
    if v not in valid:
        raise ValueError(f"{name}={v!r}: valid: {', '.join(valid)}")


@dataclass(frozen=True)
class SimConfig:
    """One simulation: fabric, workers, arrivals, prompts, the send policy and its costs.

    Fields (times in seconds, rates as named):
        topology: the :class:`TopologyConfig`.
        prefill_workers, decode_workers: P and D, one GPU each; P + D ≤ topology.gpus.
        placement: "split" (prefill on GPUs 0…P-1, decode on the next D) or "interleave"
            (alternating GPU by GPU, so some handoffs stay inside a node, on NVLink).
        model: a kvlab model name (:func:`kvlab.models.names`).
        tflops: achieved prefill TFLOP/s per prefill GPU.
        requests: how many requests arrive (≥ 1).
        load: offered prefill load: arrivals at ``load · P / mean prefill time`` per second
            (1 = prefill busy all the time). ``rate_per_s`` overrides it.
        arrival: "poisson" (exponential gaps) or "bursty" (``burst_size`` requests at once every
            ``burst_period_s``; None: the period that gives the same mean rate).
        prompt: "fixed" (``prompt_tokens``), "uniform" (integers in ``[prompt_min, prompt_max]``) or
            "lognormal" (median ``prompt_tokens``, log-σ ``prompt_sigma``, clipped to the range).
        send: "bulk" (one flow after prefill), "layerwise" (each layer as it finishes: a layer's K and V
            are one flow — they share the path and the start) or "deadline" (layers 0…r held until
            layer r ends, r from :func:`kvlab.exposure.deadline_release` with ``deadline_margin``).
        fp8, fp8_factor: send ``fp8_factor`` of the kv_dtype's bytes (0.53: fp8 with its scales, of bf16).
        kv_dtype: element type of the cache (calculator.DTYPE_BYTES).
        layer_flows: "serial" — a request's layers queue on one connection, in order, one at a time
            (kvlab.exposure.pipeline_exposure's model; the fair share is per request) — or "parallel" —
            every layer its own flow with its own fair share.
        flow_fixed_s: per-flow start cost (each bulk send, each layer).
        post_s: posting one descriptor (NIXL measured 6.8–12.8 µs); a request's posts run one after another.
        descriptors_per_layer: descriptors a layer's send posts (2: its K and V).
        bulk_descriptors: descriptors of a bulk send (None: layers · descriptors_per_layer).
        flow_gbyte_s: one flow's own ceiling, GB/s (None: the links alone limit it).
        decode_choice: "round-robin" or "least-loaded" (fewest handoffs assigned and not yet landed),
            chosen when a request's prefill starts.
        max_inflight: handoffs into one decode worker at once (None: no cap); the rest queue, FIFO.
        decode_step_s: one decode step, added to TTFT after the last byte lands.
        seed: the random seed (the same seed and config give the same results).
    """

    topology: TopologyConfig = field(default_factory=TopologyConfig)
    prefill_workers: int = 8
    decode_workers: int = 8
    placement: str = "split"
    model: str = "qwen2.5-7b"
    tflops: float = 400.0
    requests: int = 1000
    load: float = 0.7
    rate_per_s: float | None = None
    arrival: str = "poisson"
    burst_size: int = 32
    burst_period_s: float | None = None
    prompt: str = "lognormal"
    prompt_tokens: int = 2048
    prompt_min: int = 128
    prompt_max: int = 32768
    prompt_sigma: float = 0.8
    send: str = "bulk"
    fp8: bool = False
    fp8_factor: float = 0.53
    kv_dtype: str = "bf16"
    layer_flows: str = "serial"
    deadline_margin: float = 2.0
    flow_fixed_s: float = 0.0
    post_s: float = 0.0
    descriptors_per_layer: int = 2
    bulk_descriptors: int | None = None
    flow_gbyte_s: float | None = None
    decode_choice: str = "round-robin"
    max_inflight: int | None = None
    decode_step_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.topology, TopologyConfig):
            raise ValueError(f"topology={self.topology!r}: expected a TopologyConfig")
        _int("prefill_workers", self.prefill_workers, 1)
        _int("decode_workers", self.decode_workers, 1)
        if self.prefill_workers + self.decode_workers > self.topology.gpus:
            raise ValueError(f"prefill_workers + decode_workers = {self.prefill_workers + self.decode_workers} "
                             f"> topology.gpus = {self.topology.gpus}: more workers than GPUs")
        _choice("placement", self.placement, PLACEMENTS)
        if not isinstance(self.model, str) or self.model not in models.names():
            raise ValueError(f"model={self.model!r}: valid: {', '.join(models.names())}")
        _real("tflops", self.tflops, 0, True)
        if isinstance(self.requests, bool) or not isinstance(self.requests, numbers.Integral) or self.requests < 1:
            raise ValueError(f"requests={self.requests!r}: must be an integer ≥ 1 (an empty workload simulates nothing)")
        _real("load", self.load, 0, True)
        if self.rate_per_s is not None:
            _real("rate_per_s", self.rate_per_s, 0, True)
        _choice("arrival", self.arrival, ARRIVALS)
        _int("burst_size", self.burst_size, 1)
        if self.burst_period_s is not None:
            _real("burst_period_s", self.burst_period_s, 0, True)
        _choice("prompt", self.prompt, PROMPTS)
        _int("prompt_tokens", self.prompt_tokens, 1)
        _int("prompt_min", self.prompt_min, 1)
        _int("prompt_max", self.prompt_max, 1)
        if self.prompt_min > self.prompt_max:
            raise ValueError(f"prompt_min={self.prompt_min} > prompt_max={self.prompt_max}: an empty prompt range")
        _real("prompt_sigma", self.prompt_sigma, 0, False)
        _choice("send", self.send, SENDS)
        if not isinstance(self.fp8, bool):
            raise ValueError(f"fp8={self.fp8!r}: must be True or False")
        if not _is_real(self.fp8_factor) or not 0 < self.fp8_factor <= 1:
            raise ValueError(f"fp8_factor={self.fp8_factor!r}: must be in (0, 1] (fp8 bytes over kv_dtype bytes)")
        calculator.dtype_bytes(self.kv_dtype)
        _choice("layer_flows", self.layer_flows, LAYER_FLOWS)
        if not _is_real(self.deadline_margin) or self.deadline_margin < 1:
            raise ValueError(f"deadline_margin={self.deadline_margin!r}: must be a finite number ≥ 1")
        _real("flow_fixed_s", self.flow_fixed_s, 0, False)
        _real("post_s", self.post_s, 0, False)
        _int("descriptors_per_layer", self.descriptors_per_layer, 1)
        if self.bulk_descriptors is not None:
            _int("bulk_descriptors", self.bulk_descriptors, 1)
        if self.flow_gbyte_s is not None:
            _real("flow_gbyte_s", self.flow_gbyte_s, 0, True)
        _choice("decode_choice", self.decode_choice, DECODE_CHOICES)
        if self.max_inflight is not None:
            _int("max_inflight", self.max_inflight, 1)
        _real("decode_step_s", self.decode_step_s, 0, False)
        _int("seed", self.seed, 0)

    def with_(self, **changes: Any) -> SimConfig:
        """A copy with fields changed; names of TopologyConfig fields change the topology."""
        topo = {k: changes.pop(k) for k in list(changes) if k in _TOPOLOGY_FIELDS}
        unknown = set(changes) - _SIM_FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}; valid: "
                             f"{', '.join(sorted(_SIM_FIELDS | _TOPOLOGY_FIELDS))}")
        if topo:
            changes["topology"] = dataclasses.replace(changes.get("topology", self.topology), **topo)
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Flat dict of every field (topology fields prefixed ``topology.``), for summary.json and tables."""
        out = {f"topology.{k}": v for k, v in dataclasses.asdict(self.topology).items()}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "topology"})
        return out


_TOPOLOGY_FIELDS = {f.name for f in dataclasses.fields(TopologyConfig)}
_SIM_FIELDS = {f.name for f in dataclasses.fields(SimConfig)}


@dataclass(frozen=True)
class Workload:
    """The drawn requests and their per-layer costs (arrays over requests ``(M,)`` or distinct lengths ``(U,)``).

    Fields:
        arrival_s: float64 ``(M,)``, sorted arrival times from 0.
        tokens: int64 ``(M,)`` prompt lengths.
        kind: int64 ``(M,)`` index into the per-length tables below.
        prefill_s: float64 ``(U,)``, prefill seconds of each distinct length.
        layer_end_s: float64 ``(U, layers)``, when each layer has computed, seconds after prefill start.
        layer_bytes: float64 ``(U, layers)``, bytes each layer sends (fp8 factor applied).
        rate_per_s: the mean arrival rate used, requests/s.
        prefill_gpus, decode_gpus: the GPU of each prefill and decode worker.
    """

    arrival_s: np.ndarray
    tokens: np.ndarray
    kind: np.ndarray
    prefill_s: np.ndarray
    layer_end_s: np.ndarray
    layer_bytes: np.ndarray
    rate_per_s: float
    prefill_gpus: list[int]
    decode_gpus: list[int]


def _tokens(cfg: SimConfig, rng: np.random.Generator) -> np.ndarray:
    m = cfg.requests
    if cfg.prompt == "fixed":
        return np.full(m, cfg.prompt_tokens, dtype=np.int64)
    if cfg.prompt == "uniform":
        return rng.integers(cfg.prompt_min, cfg.prompt_max + 1, size=m, dtype=np.int64)
    draws = rng.lognormal(math.log(cfg.prompt_tokens), cfg.prompt_sigma, size=m)
    return np.clip(np.rint(draws), cfg.prompt_min, cfg.prompt_max).astype(np.int64)


def _placement(cfg: SimConfig) -> tuple[list[int], list[int]]:
    p, d = cfg.prefill_workers, cfg.decode_workers
    if cfg.placement == "split":
        return list(range(p)), list(range(p, p + d))
    pre, dec, gpu = [], [], 0
    while len(pre) < p or len(dec) < d:
        if len(pre) < p and (len(pre) <= len(dec) or len(dec) == d):
            pre.append(gpu)
        else:
            dec.append(gpu)
        gpu += 1
    return pre, dec


def draw(cfg: SimConfig) -> Workload:
    """Draw the requests of ``cfg`` (deterministic in ``cfg.seed``) and price them with the calculator."""
    rng = np.random.default_rng(cfg.seed)
    tokens = _tokens(cfg, rng)
    uniq, kind = np.unique(tokens, return_inverse=True)
    factor = cfg.fp8_factor if cfg.fp8 else 1.0
    rate = cfg.tflops * 1e12
    spec = models.get(cfg.model)  # once: looking a name up costs more than the arithmetic below
    # a hybrid's state layers send their fixed state instead of KV (an FP8 wire shrinks the KV only)
    state = np.asarray(calculator.state_layer_bytes(spec), float)
    prefill_s, layer_end, layer_bytes = [], [], []
    for t in uniq.tolist():
        fl = calculator.prefill_flops(spec, t)
        layer_end.append(np.cumsum(fl.per_layer()) / rate)
        prefill_s.append(fl.total / rate)
        layer_bytes.append(np.asarray(calculator.kv_layer_bytes(spec, t, cfg.kv_dtype), float) * factor + state)
    prefill = np.asarray(prefill_s)
    ends = np.asarray(layer_end)
    ends[:, -1] = prefill  # the last layer ends exactly when prefill does (no cumsum rounding)
    if cfg.rate_per_s is not None:
        per_s = float(cfg.rate_per_s)
    else:
        per_s = cfg.load * cfg.prefill_workers / float(prefill[kind].mean())
    m = cfg.requests
    if cfg.arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / per_s, size=m))
        arrivals -= arrivals[0]
    else:
        period = cfg.burst_period_s if cfg.burst_period_s is not None else cfg.burst_size / per_s
        arrivals = (np.arange(m) // cfg.burst_size) * period
        per_s = cfg.burst_size / period
    pre, dec = _placement(cfg)
    return Workload(arrival_s=arrivals.astype(np.float64), tokens=tokens, kind=kind.astype(np.int64),
                    prefill_s=prefill, layer_end_s=ends, layer_bytes=np.asarray(layer_bytes),
                    rate_per_s=per_s, prefill_gpus=pre, decode_gpus=dec)
