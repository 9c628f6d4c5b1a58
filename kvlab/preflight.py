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




def _choice(*valid: str) -> Callable:
    def check(value, what):
        if str(value) not in valid:
            raise ValueError(f"{what} = {value!r} is not valid; valid: {', '.join(valid)}{suggest(value, valid)}")
    return check


def _int_at_least(n: int) -> Callable:
    def check(value, what):
        if isinstance(value, bool) or not isinstance(value, int) or value < n:
            raise ValueError(f"{what} = {value!r}: give an int ≥ {n}")
    return check


def _paths(value, what="paths"):
    from . import ceilings

    ceilings.resolve_paths(",".join(name_list(value, what)))




# study → parameter → check(value, name); "auto" is never checked (the notebook resolves it by hardware)
CHECKS: dict[str, dict[str, Callable]] = {
    "disagg": {"backend": _choice("gloo", "ipc", "nccl", "nixl"), "model": lambda v, w: models.model_ref(v, w),
               "weights": models.check_weights, "contexts": lambda v, w: token_list(v, w, 1), "repeats": _int_at_least(1),
               "warmup": _int_at_least(0), "decode_tokens": _int_at_least(1), "block_size": _int_at_least(1),
               "bench": _choice("auto", "on", "off"), "faults": _int_at_least(0),
               "policy": _choice("fail", "retry", "recompute")},
}


def _disagg_together(params: Mapping) -> None:
    from .disagg import from_params

    from_params(params)  # the whole configuration: backend on this machine, devices, lists, dtype


# checks of several parameters together, after each has passed alone
TOGETHER: dict[str, Callable] = {"disagg": _disagg_together}


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
