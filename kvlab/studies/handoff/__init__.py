"""Handoff: what does moving prefill's KV cache to decode cost — in one copy after prefill, or layer by layer
during it? (notebook 02; seed 004 reproduced and extended)

Per context and destination (the same GPU, pinned or pageable host memory, a peer GPU) the experiment
(kvlab.studies.handoff.experiment) checks every method first — the destination poisoned, the cache moved, 20
greedy tokens decoded from it bit for bit as colocated — then times the bulk copy beside a plain copy of the same
bytes, and colocated against layer-wise prefill in counterbalanced A/B rounds; a size sweep of the same paths
gives the run's own link ceilings, and at the shortest context the layer-wise cost is split into its parts.
The analysis (analysis) gives seed 004's table, the goals under kvlab.goals' one rule, the models beside the
measurements and the findings; charts draws them; blocks makes the published tables. (The modules are not named
measure and figures: those names are the face's functions.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ... import ceilings, devices, models, steps
from ...parse import name_list, suggest, token_list
from ...results import Run
from ...sends import check_policy
from ...study import Param, at_least, check_params
from ...transfer import Destination
from .analysis import analyse
from .blocks import BLOCKS, goal_table
from .experiment import HandoffConfig, attribute_extra, config_dict, run_handoff
from .charts import FIGURES, figures

__all__ = ["NAME", "NOTEBOOK", "TITLE", "QUESTION", "FIGURES", "PARAMS", "Config", "check", "measure", "analyse",
           "figures", "BLOCKS", "goal_table"]

NAME = "handoff"
NOTEBOOK = "02_handoff"
TITLE = "The prefill→decode handoff"
QUESTION = ("What does handing prefill's KV cache to decode add to the time to first token, sent in one copy after "
            "prefill or layer by layer during it?")


def _choice(*valid: str):
    def check(value, name):
        if str(value) not in valid:
            raise ValueError(f"{name} = {value!r} is not valid; valid: {', '.join(valid)}{suggest(str(value), valid)}")
    return check


def _device() -> torch.device:
    """Where this machine's preset measures: the current GPU, or the CPU (no GPU, or KVLAB_PRESET set to cpu)."""
    return torch.device("cuda" if devices.preset() == "gpu" else "cpu")


def _destinations(value, name):
    for d in name_list(value, name):
        Destination.parse(d, _device())


def _sizes(value, name):
    for s in name_list(value, name):
        ceilings.parse_size(s)


PARAMS = (
    Param("model", "str", "auto", 'registry name, config.json or model dir; "auto": qwen2.5-7b on a GPU, kvlab-tiny '
          "on a CPU", lambda v, n: models.kv_model_ref(v, n)),
    Param("weights", "str", "random", '"random" (built from the config, seeded) or a local checkpoint dir / hub id',
          models.check_weights),
    Param("contexts", "str", "auto", 'prompt lengths in tokens, comma-separated; "auto": 1024,4096,16384,32768 (GPU) '
          "or 32,128 (CPU)", lambda v, n: token_list(v, n, 2)),
    Param("destinations", "str", "auto", 'comma-separated: same-gpu, pinned, pageable, cuda:N; "auto": every kind '
          "this machine has", _destinations),
    Param("repeats", "int", 9, "timed samples per measure after warm-up (9 or more for published numbers)", at_least(1)),
    Param("warmup", "int", 2, "untimed runs before each measure", at_least(0)),
    Param("decode_tokens", "int", 20, "greedy tokens compared with the colocated decode", at_least(1)),
    Param("interleave_short", "int", 30, "colocated/layer-wise A/B rounds at the shortest context (host-bound "
          "regime)", at_least(1)),
    Param("interleave", "int", 15, "A/B rounds at the longer contexts (never fewer than repeats)", at_least(1)),
    Param("policy", "str", "eager", 'when layers go: "eager" (each at its signal), "deadline" (held while the prefill '
          'left covers the transfer left, 2× margin), "batch:N"; not with pageable', lambda v, n: check_policy(v)),
    Param("point", "str", "cache", 'where layer i is signalled: "cache" (kvlab\'s KV arena, no module hooks) or '
          '"attention" (forward hooks)', _choice("cache", "attention")),
    Param("attribution", "str", "auto", 'split the shortest context\'s layer-wise cost into hooks / copies / wakes: '
          '"auto" (on), "off"', _choice("auto", "off")),
    Param("attribution_rounds", "int", 30, "interleaved rounds per variant for that split", at_least(1)),
    Param("ceiling_sizes", "str", "auto", 'copy sizes for this run\'s link ceilings; "auto": 64M,256M,1G (GPU) or '
          "1M,4M (CPU)", _sizes),
)

# the parameters whose "auto" means something (resolved by hardware in `check`); for the others it is refused
_AUTO = ("model", "contexts", "destinations", "attribution", "ceiling_sizes")
_PAGEABLE = ("pageable", "pageable-host", "host", "cpu")


@dataclass(frozen=True)
class Config:
    """One handoff run, every value resolved: the model (registry name, config.json or folder) and its weights;
    contexts in tokens; destinations as given (same-gpu, pinned, pageable, cuda:N); the device prefill runs on
    ("cuda" or "cpu"); samples and A/B rounds; the send policy and signal point; whether to split the shortest
    context's cost (attribution, with its rounds); the ceiling sweep's copy sizes in bytes."""

    model: str
    weights: str
    contexts: list
    destinations: list
    device: str
    repeats: int
    warmup: int
    decode_tokens: int
    interleave_short: int
    interleave: int
    policy: str
    point: str
    attribution: bool
    attribution_rounds: int
    ceiling_sizes: list

    def handoff(self) -> HandoffConfig:
        """The experiment's own configuration (kvlab.studies.handoff.experiment.run_handoff)."""
        return HandoffConfig(contexts=list(self.contexts), destinations=list(self.destinations), repeats=self.repeats,
                             warmup=self.warmup, decode_tokens=self.decode_tokens,
                             interleave_short=self.interleave_short, interleave=self.interleave,
                             short_context=min(self.contexts), point=self.point, policy=self.policy)


def _auto(value, gpu, cpu, on_gpu: bool):
    return (gpu if on_gpu else cpu) if value == "auto" else value


def check(params) -> Config:
    """The run's Config from notebook or command-line values: each value checked, "auto" resolved for this
    machine's hardware, then the combinations (a policy other than eager sends to no pageable host; a registry
    model's layers bound batch:N). ValueError in one line; nothing allocated."""
    p = check_params(PARAMS, params, NAME)
    for name in p:
        if p[name] == "auto" and name not in _AUTO:
            raise ValueError(f"{name} = 'auto': this parameter has no automatic value; give a value "
                             f"({next(x.help for x in PARAMS if x.name == name)})")
    device = _device()
    on_gpu = device.type == "cuda"
    policy = check_policy(p["policy"])
    eager = policy == "eager"
    # "auto": every kind this machine has — but a policy other than eager cannot send to pageable host
    auto_dests = ("same-gpu,pinned" + (",pageable" if eager else "")
                  + (",cuda:1" if on_gpu and torch.cuda.device_count() > 1 else ""))
    dests = name_list(_auto(p["destinations"], auto_dests, "same-gpu,pageable" if eager else "same-gpu", on_gpu),
                      "destinations")
    for d in dests:
        Destination.parse(d, device)  # exists on this machine (cuda:N, pinned needs CUDA)
    if not eager:
        bad = [d for d in dests if d.strip().lower() in _PAGEABLE]
        if bad:
            raise ValueError(f"policy = {p['policy']!r} cannot send to {bad[0]!r}: a policy other than 'eager' needs a "
                             "GPU destination or pinned host; drop pageable from destinations or use policy eager")
    model = _auto(p["model"], "qwen2.5-7b", "kvlab-tiny", on_gpu)
    contexts = token_list(_auto(p["contexts"], "1024,4096,16384,32768", "32,128", on_gpu), "contexts", 2)
    if p["weights"] == "random":
        _fits_layers(model, policy)
    sizes = ceilings.resolve_sizes(_auto(p["ceiling_sizes"], "64M,256M,1G", "1M,4M", on_gpu), device)
    return Config(model=model, weights=p["weights"], contexts=contexts, destinations=dests, device=device.type,
                  repeats=p["repeats"], warmup=p["warmup"], decode_tokens=p["decode_tokens"],
                  interleave_short=p["interleave_short"], interleave=p["interleave"], policy=policy, point=p["point"],
                  attribution=p["attribution"] == "auto", attribution_rounds=p["attribution_rounds"],
                  ceiling_sizes=sizes)


def _fits_layers(model: str, policy: str) -> None:
    """A registry model's layers bound batch:N. The contexts are checked against the built model's positions and
    the device's free memory in `measure`, before anything big is allocated (kvlab.steps.check_request): a sweep
    of a GPU's contexts stays a valid dry run on a CPU, whose "auto" model is kvlab-tiny."""
    try:
        spec = models.get(model)
    except (ValueError, OSError):  # a model folder: its config is read when the model is built
        return
    if policy.startswith("batch:") and int(policy[6:]) > spec.layers:
        raise ValueError(f"policy = {policy!r}: N must be an int in 1…{spec.layers} ({model} has {spec.layers} layers)")


def measure(cfg: Config, run: Run) -> None:
    """Build the model, refuse a request it or the device cannot take (before anything big is allocated), then
    measure: the link ceilings of the paths the destinations use (ceilings.csv), the handoff (results.csv, one row
    per timed sample; checks.csv, one row per moved cache — AssertionError when one did not decode as colocated),
    and at the shortest context the attribution rounds (attribution_rounds.csv) unless attribution is off."""
    device = torch.device(cfg.device)
    # a registry name or a config.json / model folder: models.build reads either
    lm = models.build(cfg.model, weights=cfg.weights, device=device, dtype=torch.bfloat16)
    hcfg = cfg.handoff()
    dests = steps.check_request(lm, cfg.contexts, cfg.destinations, device, policy=cfg.policy)
    paths = {d.label: steps.ceiling_path(d, device) for d in dests}
    resolved = dict(model=cfg.model, contexts=cfg.contexts, destinations=[d.label for d in dests],
                    ceiling_paths=paths, device=str(device), config=config_dict(hcfg), layerwise_signal=cfg.point,
                    layerwise_policy=cfg.policy, layers=lm.config.num_hidden_layers)
    run.update(resolved=resolved)

    ceil_df = ceilings.measure(sorted(set(paths.values())), cfg.ceiling_sizes, n=max(cfg.repeats, 9), warmup=3,
                               device=device)
    run.save_table(ceil_df, "ceilings")
    # what the sweep was, for the fit its analysis makes (a table read back from CSV has lost df.attrs)
    run.update(resolved=dict(resolved, ceiling_sweep=dict(ceil_df.attrs, sizes_bytes=list(cfg.ceiling_sizes))))

    bar = tqdm(total=len(cfg.contexts) * len(dests) * 2, desc="handoff")

    def progress(msg):
        bar.set_postfix_str(msg[-60:])
        if "checked and timed" in msg:
            bar.update(1)

    timings, checks = run_handoff(lm, hcfg, device=device, progress=progress)
    bar.close()
    run.save_table(timings, "results")
    run.save_table(checks, "checks")
    bad = checks[~(checks.tokens_match & checks.logits_equal & (checks.poison_left == 0))]
    if len(bad):
        raise AssertionError(f"{len(bad)} transfers did not reproduce the colocated decode:\n{bad}")

    if cfg.attribution:
        rows = attribute_extra(lm, min(cfg.contexts), cfg.destinations, rounds=cfg.attribution_rounds,
                               warmup=cfg.warmup, device=device, progress=print)
        run.save_table(rows, "attribution_rounds")
