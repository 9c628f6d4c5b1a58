"""Model shapes for the KV-cache bill: a spec per model, a registry of public configs, a builder.

Everything the calculator needs about a model is in :class:`ModelSpec`: how many layers keep a KV
cache, how many KV heads of what size, which layers only keep a sliding window, and how many
parameters a token passes through (for prefill FLOPs). Specs come from Hugging Face ``config.json``
values through one code path, :func:`from_hf_config`, whether the config is one of the published
configs kept below as data, a ``transformers`` config object, or a file on disk.

This module imports neither torch nor transformers at import time, so ``kvlab.calculator`` (pure
arithmetic) stays fast to import; :func:`build` and config-object inputs import them when called.

Units: ``params`` and ``active_params`` are parameter counts (not bytes); sizes such as
``hidden_size`` and ``head_dim`` are element counts per vector.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .model_names import unknown_model
from .model_config import FIELD_NAMES, first, param_count, sliding, state_layout, with_layer_types
from .model_spec import MAX_LAYERS, MLA_MODEL_TYPES, ModelSpec
from .model_registry import REGISTRY, alias_table, aliases, names, norm_name, registry_source

__all__ = [
    "ModelSpec",
    "REGISTRY",
    "get",
    "names",
    "aliases",
    "from_hf_config",
    "from_ref",
    "model_ref",
    "kv_model_ref",
    "param_count",
    "build",
]

def get(name: str) -> ModelSpec:
    """The spec of a registry model, by name, case-insensitively.

    Accepts registry names (``names()``), the Hugging Face repo id (``"meta-llama/Llama-3.1-8B"``)
    and common aliases (``"qwen2.5-7b-instruct"``): instruct/chat variants share the base shape.
    A :class:`ModelSpec` is returned unchanged. Unknown name → ValueError listing known names.
    """
    if isinstance(name, ModelSpec):
        return name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name {name!r}: expected a non-empty string; known: {names()}")
    key = alias_table().get(norm_name(name))
    if key is None:  # a hint only for the same model spelled another way (kvlab.model_names)
        raise ValueError(unknown_model(name, norm_name(name), alias_table(), names())
                         + " (or pass a config.json path to models.from_hf_config)")
    entry = REGISTRY[key]
    # A fresh deep copy each time, so a caller editing spec.hf_config cannot change the registry.
    return from_hf_config(copy.deepcopy(entry["config"]), name=key,
                          source=registry_source(key, entry))


# ---- from_hf_config ---------------------------------------------------------------------------

# Some model families spell the same quantity differently; the first name present wins.


_MAX_CONFIG_BYTES = 16 << 20  # a config.json is kilobytes; more is not a config


def _to_dict(x: Any) -> tuple[dict[str, Any], str]:
    """Normalise the accepted inputs to (config dict, where it came from)."""
    if isinstance(x, ModelSpec):
        return copy.deepcopy(x.hf_config), x.source
    if isinstance(x, Mapping):
        return copy.deepcopy(dict(x)), "dict"
    if isinstance(x, (str, os.PathLike)):
        p = Path(x).expanduser()
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"config path {str(x)!r}: no such file (expected a config.json or a "
                             "directory holding one)")
        if p.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"config file {str(p)!r} is {p.stat().st_size:,} bytes; a config.json is at most "
                             f"{_MAX_CONFIG_BYTES:,}")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {str(p)!r} is not valid JSON: {e}") from None
        except (RecursionError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {str(p)!r} cannot be read as a config ({type(e).__name__})") from None
        if not isinstance(d, dict):
            raise ValueError(f"config file {str(p)!r} holds a {type(d).__name__}, not a JSON "
                             "object")
        return d, f"config: {p}"
    if hasattr(x, "to_dict") and hasattr(x, "model_type"):
        # A transformers PretrainedConfig: its to_dict() carries derived fields (layer_types,
        # head_dim) as transformers resolved them, which is what the model will actually use.
        return x.to_dict(), f"transformers {type(x).__name__}"
    raise ValueError(f"cannot read a model config from {type(x).__name__}; pass a transformers "
                     "PretrainedConfig, a dict, a path to config.json, or a directory holding one")


def from_hf_config(x: Any, *, name: str | None = None, source: str | None = None,
                   params: int | None = None, active_params: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face config.

    Args:
        x: a ``transformers.PretrainedConfig``, a dict of config.json values, a path to a
            config.json, or a directory holding one. Multimodal configs with a ``text_config``
            use that.
        name: spec name; default: the config's ``_name_or_path`` or its model_type.
        source: where the numbers came from; default: describes ``x``.
        params, active_params: parameter counts to use instead of the computed ones (see
            :func:`param_count`); active defaults to params for a dense model.

    Derived where configs leave it implicit: ``head_dim = hidden_size // heads`` (unless given);
    ``kv_heads = heads`` when ``num_key_value_heads`` is absent; attention kind (``mla`` when
    ``kv_lora_rank`` is present or the model_type is a DeepSeek-V2/V3 one, else ``mha``/``mqa``/``gqa`` from KV vs query heads); sliding layers
    (see ``sliding``). Missing required fields → ValueError naming them.
    """
    cfg, where = _to_dict(x)
    if first(cfg, FIELD_NAMES["layers"]) is None and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type",
                                                                         cfg.get("model_type"))}

    missing = [keys[0] for keys in FIELD_NAMES.values() if first(cfg, keys) is None]
    # MLA by the field's presence (a 0 is then refused as a width, not read as "no MLA") or by a family
    # that always uses it (its missing latent width is then named, not silently counted as GQA)
    mla = cfg.get("kv_lora_rank") is not None or cfg.get("model_type") in MLA_MODEL_TYPES
    if mla:
        missing += [k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
                    if cfg.get(k) is None]
    if cfg.get("intermediate_size") is None and cfg.get("moe_intermediate_size") is None:
        missing.append("intermediate_size")
    if not cfg.get("model_type"):
        missing.append("model_type")
    if missing:
        raise ValueError(f"model config ({where}) is missing required field(s): "
                         f"{', '.join(missing)}")
    if not isinstance(cfg["model_type"], str):
        raise ValueError(f"model config ({where}): model_type={cfg['model_type']!r} must be a string such as 'qwen2'")
    if cfg.get("tie_word_embeddings") is not None and not isinstance(cfg["tie_word_embeddings"], bool):
        raise ValueError(f"model config ({where}): tie_word_embeddings={cfg['tie_word_embeddings']!r} must be true "
                         "or false (JSON booleans)")
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1):
            raise ValueError(f"model config ({where}): {key}={v!r} must be a number in (0, 1) (a norm's epsilon; "
                             "anything else gives NaN or meaningless logits)")

    def as_int(key_or_keys: str | tuple[str, ...]) -> int:
        keys = (key_or_keys,) if isinstance(key_or_keys, str) else key_or_keys
        v = first(cfg, keys)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or int(v) != v
                or v < 1):
            raise ValueError(f"model config ({where}): {keys[0]}={v!r} must be a positive integer")
        return int(v)

    layers = as_int(FIELD_NAMES["layers"])
    if layers > MAX_LAYERS:  # before anything builds a list per layer
        raise ValueError(f"model config ({where}): {FIELD_NAMES['layers'][0]}={layers} is more decoder layers than "
                         f"any model has; kvlab reads at most {MAX_LAYERS:,}")
    hidden = as_int(FIELD_NAMES["hidden_size"])
    heads = as_int(FIELD_NAMES["heads"])
    vocab = as_int("vocab_size")
    kv_heads = (as_int("num_key_value_heads") if cfg.get("num_key_value_heads") is not None
                else heads)
    if kv_heads > heads or heads % kv_heads:
        raise ValueError(f"model config ({where}): num_key_value_heads={kv_heads} must divide "
                         f"num_attention_heads={heads}")

    if mla:
        # transformers sets head_dim to the RoPE width for DeepSeek; a query·key dot product
        # spans nope + rope.
        head_dim = as_int("qk_nope_head_dim") + as_int("qk_rope_head_dim")
        attention = "mla"
        kv_lora_rank, rope_dim = as_int("kv_lora_rank"), as_int("qk_rope_head_dim")
    else:
        if cfg.get("head_dim") is not None:
            head_dim = as_int("head_dim")
        elif hidden % heads:
            raise ValueError(f"model config ({where}): hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={heads} and no head_dim is given")
        else:
            head_dim = hidden // heads
        attention = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
        kv_lora_rank = rope_dim = None

    inter = as_int("intermediate_size" if cfg.get("intermediate_size") is not None else "moe_intermediate_size")
    typed = with_layer_types(cfg, where)
    window, sliding_layers = sliding(typed, layers)
    state_layers, conv_state, recurrent_state = state_layout(typed, layers, where)
    total, active = param_count(cfg)
    how = "params: computed from the config"
    if params is not None:
        total = int(params)
        active = int(active_params) if active_params is not None else total
        how = "params: given"
    elif active_params is not None:
        active = int(active_params)

    max_pos = (as_int(("max_position_embeddings", "n_positions"))
               if first(cfg, ("max_position_embeddings", "n_positions")) is not None else None)
    spec_name = name or cfg.get("_name_or_path") or cfg["model_type"]
    return ModelSpec(
        name=spec_name,
        architecture=str(cfg["model_type"]),
        layers=layers,
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        params=total,
        active_params=active,
        attention=attention,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        sliding_window=window,
        sliding_layers=sliding_layers,
        state_layers=state_layers,
        conv_state=conv_state,
        recurrent_state=recurrent_state,
        max_positions=max_pos,
        source=source if source is not None else f"{where}; {how}",
        hf_config=cfg,
    )


# ---- build: a transformers model from a spec -------------------------------------------------

_DTYPE_NAMES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}


def _resolve_dtype(dtype: Any):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype={dtype}: valid model dtypes are torch.bfloat16, "
                             "torch.float16, torch.float32 or None")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return getattr(torch, _DTYPE_NAMES[key])
    raise ValueError(f"dtype={dtype!r}: valid are torch.bfloat16/float16/float32, None, or one of "
                     f"{sorted(_DTYPE_NAMES)}")


def available_devices() -> list[str]:
    """Device strings usable on this machine: ``"cpu"``, ``"meta"``, ``"cuda:N"`` for each GPU."""
    import torch

    devs = ["cpu", "meta"]
    if torch.cuda.is_available():
        devs += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devs.append("mps")
    return devs


def _resolve_device(device: Any):
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device; available: "
                         f"{available_devices()}") from e
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if dev.index is None else dev.index
        if index >= n:
            raise ValueError(f"device={device!r}: this machine has {n} CUDA device(s); "
                             f"available: {available_devices()}")
        return torch.device("cuda", index)
    if dev.type == "mps" and "mps" not in available_devices():
        raise ValueError(f"device={device!r} is not available; available: {available_devices()}")
    if dev.type not in ("cpu", "meta", "cuda", "mps"):
        raise ValueError(f"device={device!r} is not supported; available: {available_devices()}")
    return dev


def _looks_like_path(s: str) -> bool:
    """A string meant as a filesystem path rather than a hub id (hub ids are ``org/name``)."""
    return (s.startswith(("/", "./", "../", "~", ".\\")) or s.count("/") >= 2 or "\\" in s
            or s.endswith(".json"))


def build(spec_or_path: Any, weights: str = "random", device: Any = "cpu",
          dtype: Any = "bfloat16", *, seed: int = 0, attn_implementation: str = "sdpa"):
    """A ``transformers`` causal LM in eval mode, with random or real weights.

    Args:
        spec_or_path: a :class:`ModelSpec`, a registry name (``"kvlab-tiny"``), a config dict or
            transformers config, or a path to a config.json / model directory.
        weights: ``"random"`` — initialise from the spec's config, directly on ``device`` (a
            ``torch.device`` context, so a 7B model never passes through host memory), seeded
            with ``seed`` so two builds give identical weights; or a local directory / hub id for
            ``from_pretrained`` (a local directory works offline). With real weights, the
            checkpoint's config must agree with ``spec_or_path`` on the KV-relevant shape.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"meta"`` (shapes only) or a torch.device.
        dtype: parameter dtype: ``torch.bfloat16`` (default, also ``"bf16"``), ``torch.float16``,
            ``torch.float32``; ``None`` keeps the checkpoint's dtype (float32 for random weights).
        seed: RNG seed for random weights; the caller's RNG state is left untouched.
        attn_implementation: passed to transformers (``"sdpa"`` by default; ``"eager"`` works).

    Returns:
        ``AutoModelForCausalLM`` instance on ``device`` in eval mode.

    Raises:
        ValueError: unknown model, bad device (lists the available ones), bad dtype, a weights
            path that does not exist, or a checkpoint whose shape differs from the spec.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = _resolve_device(device)
    torch_dtype = _resolve_dtype(dtype)
    if not isinstance(weights, (str, os.PathLike)) or not str(weights).strip():
        raise ValueError(f"weights={weights!r}: use 'random', a local model directory or a hub id")
    weights = str(weights)

    if isinstance(spec_or_path, ModelSpec):
        spec = spec_or_path
    elif isinstance(spec_or_path, str) and not os.path.exists(os.path.expanduser(spec_or_path)):
        if _looks_like_path(spec_or_path):
            raise ValueError(f"model path {spec_or_path!r} does not exist")
        spec = get(spec_or_path)
    else:
        spec = from_hf_config(spec_or_path)

    if weights == "random":
        cfg = AutoConfig.for_model(**copy.deepcopy(spec.hf_config))
        # fork_rng restores the caller's CPU (and target GPU) RNG state afterwards. Seed only the
        # generators init touches: torch.manual_seed would reseed (and so initialise) every GPU.
        gpus = [dev.index] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus):
            torch.default_generator.manual_seed(seed)
            if dev.type == "cuda":
                with torch.cuda.device(dev):
                    torch.cuda.manual_seed(seed)
            with dev:
                model = AutoModelForCausalLM.from_config(
                    cfg, attn_implementation=attn_implementation,
                    dtype=torch_dtype if torch_dtype is not None else torch.float32)
        return model.eval()

    local = os.path.isdir(os.path.expanduser(weights))
    if not local and _looks_like_path(weights):
        raise ValueError(f"weights={weights!r}: no such directory (use 'random', a local model "
                         "directory or a hub id)")
    src = os.path.expanduser(weights) if local else weights
    ckpt = from_hf_config(AutoConfig.from_pretrained(src))
    shape = ("layers", "heads", "kv_heads", "head_dim", "hidden_size", "attention",
             "kv_lora_rank", "qk_rope_head_dim")
    diff = {k: (getattr(spec, k), getattr(ckpt, k)) for k in shape
            if getattr(spec, k) != getattr(ckpt, k)}
    if diff:
        raise ValueError(f"weights {weights!r} do not match {spec.name!r}: "
                         + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items()))
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation,
                              "dtype": torch_dtype if torch_dtype is not None else "auto"}
    if dev.type == "meta":
        raise ValueError("device='meta' only makes sense with weights='random'")
    import importlib.util

    # With accelerate, transformers streams the checkpoint straight onto the device; without it
    # (it is not a kvlab dependency) a device_map is refused, so load on the host and move.
    if dev.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = {"": dev}
    model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    return model.to(dev).eval()


def model_ref(value, what: str = "model") -> str:
    """A local config.json / model folder, or a registry name (any accepted alias, a hub id such as
    "meta-llama/Llama-3.1-8B"); else ValueError naming the value, a registry name only when it is the same model
    spelled another way, and the known names."""
    name = str(value).strip()
    p = Path(name).expanduser()
    if p.is_file() or (p.is_dir() and (p / "config.json").is_file()):
        return name
    if alias_table().get(norm_name(name)) is not None:
        return name
    if os.sep in name or name.endswith(".json"):
        raise ValueError(f"{what} = {name!r}: no such file, not a folder with a config.json, and not a registry name")
    raise ValueError(unknown_model(name, norm_name(name), alias_table(), names())
                     + " (or give a config.json path or a model folder)")


def kv_model_ref(value, what: str = "model") -> str:
    """`model_ref` for the paths that move or build a KV cache layer by layer: a hybrid (state layers that keep no
    K and V) is refused too, in one line naming the value and the field."""
    name = model_ref(value, what)
    try:
        from_ref(name, what).require_kv_only("kvlab's transfers")
    except ValueError as err:
        raise ValueError(f"{what} = {name!r}: {err}") from None
    return name


def from_ref(value, what: str = "model") -> ModelSpec:
    """The spec `value` names (`model_ref`): a config.json or model folder read by `from_hf_config` (named after
    its folder), else the registry's."""
    name = model_ref(value, what)
    p = Path(name).expanduser()
    if p.exists():
        folder = p if p.is_dir() else p.parent
        return from_hf_config(p, name=folder.resolve().name)
    return get(name)


def check_weights(value, what: str = "weights") -> None:
    """'random', a local checkpoint folder, or a hub id (org/name) already in this machine's Hugging Face cache — kvlab
    loads weights offline, so an id it would have to download is refused here, before a run folder exists, rather
    than in the workers; else ValueError naming the value."""
    v = str(value).strip()
    if v == "random" or Path(v).expanduser().is_dir():
        return
    if "/" in v and not Path(v).exists() and v.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            snapshot_download(v, local_files_only=True)
            return
        except Exception as err:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), or not a valid repo id
            raise ValueError(f"{what} = {v!r}: not in this machine's Hugging Face cache ({type(err).__name__}); "
                             "kvlab loads weights offline: give a local checkpoint folder, or download it "
                             "first") from None
    raise ValueError(f"{what} = {v!r}: give 'random', a local checkpoint folder, or a hub id such as org/name")
