"""Every value a user gives a notebook, checked before a kernel starts.

`kvlab run`, `run-all` and `sweep` call `check(study, params)` on the values given on the command line (never
on "auto", which the notebook resolves by hardware): a bad value is one line naming it and what is valid, and
no run folder is made. The notebooks parse the same values with the same functions (`token_list`,
`name_list`), so what is accepted here is what runs there.

What a user types for a list is accepted in every spelling: ``1024,4096``, ``[1024, 4096]`` (YAML) and, for
token counts, ``1k,32k``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from . import models
from .parse import name_list, suggest, token_list

__all__ = ["check", "CHECKS"]


class _Bad(ValueError):
    pass


def _destinations(value, what="destinations"):
    import torch

    from .transfer import Destination

    src = "cuda" if torch.cuda.is_available() else "cpu"
    for d in name_list(value, what):
        try:
            Destination.parse(d, src)
        except RuntimeError:  # torch.device("cuda:one")
            raise ValueError(f"unknown destination {d!r}; valid: 'same-gpu', 'cuda:N' (N a GPU index), 'pinned', "
                             "'pageable'") from None


def _one(items: list, value, what: str):
    if len(items) != 1:
        raise ValueError(f"{what} = {value!r}: give one value, not {len(items)} (this notebook takes a single {what})")
    return items


def _policy(value, what="policy"):
    from .sends import check_policy

    check_policy(value)


def _choice(*valid: str) -> Callable:
    def check(value, what):
        if str(value) not in valid:
            raise ValueError(f"{what} = {value!r} is not valid; valid: {', '.join(valid)}{suggest(value, valid)}")
    return check


def _positive_number(value, what):
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{what} = {value!r}: give a finite number > 0")


def _int_at_least(n: int) -> Callable:
    def check(value, what):
        if isinstance(value, bool) or not isinstance(value, int) or value < n:
            raise ValueError(f"{what} = {value!r}: give an int ≥ {n}")
    return check


def _paths(value, what="paths"):
    from . import ceilings

    ceilings.resolve_paths(",".join(name_list(value, what)))


def _sizes(value, what="sizes"):
    from . import ceilings

    for s in name_list(value, what):
        ceilings.parse_size(s)


def _methods(value, what="methods"):
    from .paged_bench import METHODS

    for m in name_list(value, what):
        if m not in METHODS:
            raise ValueError(f"{what}: unknown method {m!r}; valid: {', '.join(METHODS)}{suggest(m, METHODS)}")


def _layout(value, what="layout"):
    from .paged_bench import check_layout

    check_layout(value)


def _patterns(value, what="patterns"):
    from .clocks import PATTERNS

    if str(value) == "off":
        return
    for p in [x.strip() for x in str(value).split(";") if x.strip()]:
        if p not in PATTERNS:
            raise ValueError(f"{what}: unknown pattern {p!r}; valid: {', '.join(PATTERNS)}{suggest(p, PATTERNS)}")


def _model_names(value, what="models"):
    if value == "all":
        return
    for m in name_list(value, what):
        models.model_ref(m, what)


def _links(value, what="links"):
    from . import calculator

    for link in name_list(value, what):
        calculator.link(link)


def _kv_dtype(value, what="kv_dtype"):
    from . import calculator

    calculator.dtype_bytes(value)


def _exposure_cases(value, what="exposure_cases"):
    for case in name_list(value, what):
        model, _, dtype = case.partition(":")
        models.model_ref(model, what)
        if dtype:
            _kv_dtype(dtype, what)


# study → parameter → check(value, name); "auto" is never checked (the notebook resolves it by hardware)
CHECKS: dict[str, dict[str, Callable]] = {
    "handoff": {"model": lambda v, w: models.model_ref(v, w), "weights": models.check_weights, "contexts": lambda v, w: token_list(v, w, 2),
                "destinations": _destinations, "policy": _policy, "point": _choice("cache", "attention"),
                "attribution": _choice("auto", "off"), "ceiling_sizes": _sizes, "repeats": _int_at_least(1),
                "warmup": _int_at_least(0), "decode_tokens": _int_at_least(1), "interleave": _int_at_least(1),
                "interleave_short": _int_at_least(1), "attribution_rounds": _int_at_least(1)},
    "overlap_timeline": {"model": lambda v, w: models.model_ref(v, w), "context": lambda v, w: _one(token_list(v, w, 2), v, w),
                         "destination": lambda v, w: (_one(name_list(v, w), v, w), _destinations(v, w)), "transport": _choice("copy"),
                         "send_mode": _choice("auto", "event"), "repeats": _int_at_least(1),
                         "events": _choice("auto", "off"), "event_rounds": _int_at_least(1), "patterns": _patterns,
                         "pattern_rounds": _int_at_least(1)},
    "paged_transfer": {"contexts": lambda v, w: token_list(v, w, 1), "block_sizes": lambda v, w: token_list(v, w, 1),
                       "methods": _methods, "destinations": _destinations, "layout": _layout,
                       "pool_layout": _choice("nhd", "hnd"), "repeats": _int_at_least(1), "warmup": _int_at_least(0),
                       "check_model": lambda v, w: v == "" or models.model_ref(v, w)},
    "calculator": {"models": _model_names, "ratio_models": _model_names, "tp_models": _model_names,
                   "links": _links, "ratio_links": _links, "tp_link": _links, "kv_dtype": _kv_dtype,
                   "exposure_cases": _exposure_cases, "prompt_tokens": _int_at_least(1),
                   "tp_max": _int_at_least(1), "tflops": _positive_number, "ratio_min_tokens": _int_at_least(1),
                   "ratio_max_tokens": _int_at_least(1)},
}


def _handoff_together(params: Mapping) -> None:
    from .sends import check_policy

    policy, dests = params.get("policy", "eager"), params.get("destinations", "auto")
    if check_policy(policy) != "eager" and dests != "auto":
        bad = [d for d in name_list(dests, "destinations") if d.strip().lower() in ("pageable", "pageable-host", "host", "cpu")]
        if bad:
            raise ValueError(f"policy = {policy!r} cannot send to {bad[0]!r}: a policy other than 'eager' needs a GPU "
                             "destination or pinned host; drop pageable from destinations or use policy eager")


def _calculator_together(params: Mapping) -> None:
    lo, hi = params.get("ratio_min_tokens", 128), params.get("ratio_max_tokens", 131072)
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        raise ValueError(f"ratio_min_tokens = {lo} > ratio_max_tokens = {hi}: the sweep runs from the first up to the "
                         "second")


# checks of several parameters together, after each has passed alone
TOGETHER: dict[str, Callable] = {"handoff": _handoff_together, "calculator": _calculator_together}


def check(study: str, params: Mapping) -> None:
    """ValueError (one line, naming the parameter, its value and what is valid) for the first value in
    ``params`` that the study's notebook would refuse; "auto" values and parameters without a check pass."""
    checks = CHECKS.get(study, {})
    for name, value in params.items():
        fn = checks.get(name)
        if fn is None or value == "auto" or (isinstance(value, str) and value.strip() == "auto"):
            continue
        try:
            fn(value, name)
        except ValueError as err:
            text = str(err).splitlines()[0] if str(err) else repr(err)
            raise _Bad(text if name in text else f"{name} = {value!r}: {text}") from None
    if study in TOGETHER:
        TOGETHER[study](params)
