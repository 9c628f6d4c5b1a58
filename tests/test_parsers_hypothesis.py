"""Parsers that are total (issue 26): for arbitrary inputs every parser kvlab applies to what users give it returns a
checked value or raises kvlab's own one-line error — never another exception, never a hang. Hypothesis generates
the inputs in process, HYPOTHESIS_EXAMPLES of them per parser (10,000 by default, what CI runs; the profile `big`,
`HYPOTHESIS_PROFILE=big`, runs ten times as many on demand), each with a deadline."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import models, parse, params, runner, study
from kvlab.tracefmt import TraceError
from kvlab.tracefmt.kineto import parse_kineto

N = int(os.environ.get("HYPOTHESIS_EXAMPLES", "10000"))
settings.register_profile("ci", max_examples=N, deadline=2000, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("big", max_examples=10 * N, deadline=2000, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# JSON values of every kind, nested a little; the numbers include the ones JSON writers emit for inf and nan
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
# text that looks like what people type: YAML and list spellings, token counts, units
typed = st.one_of(st.text(max_size=40), st.from_regex(r"\[?[0-9kK_, .e+-]{0,20}\]?", fullmatch=True),
                  st.from_regex(r"[a-z&*:\[\]{}, \n-]{0,40}", fullmatch=True))


def _one_line(err: BaseException) -> None:
    assert "\n" not in str(err).strip() or isinstance(err, runner.UsageError), str(err)[:300]


@given(typed)
def test_yaml_load(text):
    try:
        parse.yaml_load(text, "-p x")
    except parse.YAMLInputError as err:
        _one_line(err)


@given(st.one_of(typed, json_values))
def test_token_list(value):
    try:
        out = parse.token_list(value, "contexts")
    except ValueError as err:
        _one_line(err)
    else:
        assert out and all(isinstance(n, int) and n >= 1 for n in out)


@given(st.one_of(typed, json_values))
def test_name_list(value):
    try:
        out = parse.name_list(value, "destinations")
    except ValueError as err:
        _one_line(err)
    else:
        assert out and all(isinstance(v, str) and v for v in out)


_FIELDS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "vocab_size", "intermediate_size", "model_type", "max_position_embeddings", "tie_word_embeddings",
           "rms_norm_eps", "sliding_window", "layer_types", "kv_lora_rank", "text_config", "torch_dtype"]


@given(st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=12), st.booleans())
def test_model_config(change, start_from_a_real_one):
    cfg = dict(models.get("kvlab-tiny").hf_config) if start_from_a_real_one else {}
    cfg.update(change)
    try:
        spec = models.from_hf_config(json.loads(json.dumps(cfg)))
    except ValueError as err:
        _one_line(err)
    else:
        assert spec.layers >= 1 and spec.kv_heads >= 1 and spec.head_dim >= 1 and spec.intermediate_size >= 1


_EVENT_KEYS = ["ph", "cat", "name", "ts", "dur", "args", "pid", "tid"]
events = st.lists(st.one_of(json_values, st.dictionaries(st.sampled_from(_EVENT_KEYS), json_values, max_size=8),
                            st.fixed_dictionaries({"ph": st.just("X"), "cat": st.sampled_from(["kernel", "cpu_op"]),
                                                   "name": st.text(max_size=5), "ts": scalars, "dur": scalars,
                                                   "args": json_values})), max_size=6)


@given(st.one_of(events.map(lambda e: {"traceEvents": e}), json_values, events))
def test_kineto_trace(doc):
    try:
        raw = json.dumps(doc).encode()
    except (ValueError, OverflowError):
        return
    try:
        parse_kineto(raw, "t.json")
    except TraceError as err:
        _one_line(err)


@given(st.binary(max_size=64))
def test_kineto_bytes(raw):
    try:
        parse_kineto(raw, "t.json")
    except TraceError as err:
        _one_line(err)


@given(st.one_of(typed, json_values.map(json.dumps)), st.booleans())
def test_sweep_grid(text, as_json):
    try:
        points = runner.parse_grid(text, "grid.yaml", as_json=as_json)
    except runner.UsageError:
        pass
    else:
        assert points and all(isinstance(p, dict) for p in points)


_PARAMS = (study.Param("contexts", "str", "auto", "prompt lengths"), study.Param("repeats", "int", 9, "rounds",
           lambda v, n: None if v >= 1 else (_ for _ in ()).throw(ValueError(f"{n} = {v}: give ≥ 1"))),
           study.Param("tflops", "float", 400.0, "TFLOP/s"), study.Param("tune", "bool", True, "tune"),
           study.Param("links", "list", ["100G"], "links"))


@given(st.dictionaries(st.sampled_from(["contexts", "repeats", "tflops", "tune", "links", "other"]), json_values,
                       max_size=5))
def test_study_parameters(values):
    try:
        out = study.check_params(_PARAMS, values, "toy")
    except ValueError as err:
        _one_line(err)
    else:
        assert set(out) == {p.name for p in _PARAMS}


_DECLARED = params.parse_parameter_cell('contexts: str = "auto"  # x\nrepeats: int = 9  # y\nratio: float = 1.0  # z\n'
                                        'tune: bool = True  # t\nlinks: list = ["a"]  # l\nmode: int | str = "auto"  # m\n')


@given(st.lists(st.tuples(st.sampled_from(list(_DECLARED) + ["nope"]), typed), max_size=4))
def test_command_line_parameters(pairs):
    try:
        params.parse_params(pairs, _DECLARED, "00_toy.ipynb")
    except params.UsageError as err:
        assert str(err)


@pytest.mark.parametrize("argv", [["calc", "kvlab-tiny", "--tokens", "1e400"], ["calc", "nope", "--tokens", "8k"],
                                  ["run", "handoff", "-p", "contexts", "&a [*a]"], ["sweep", "handoff", "--grid", "/dev/zero"]])
def test_a_handful_of_command_lines_end_to_end_in_one_line(argv, tmp_path):
    from conftest import cpu_env, kvlab_command

    done = kvlab_command(argv, cpu_env(tmp_path), timeout=120)
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
