"""Bad input found by issue 16's campaign, each refused in one line before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import cpu_env as _env
from conftest import kvlab_command
from kvlab import models, paths


def _one_line(done, says):
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr


_BASE = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
             intermediate_size=128)


@pytest.mark.parametrize("extra, says", [
    # a hybrid whose state kvlab does not know the shape of, or a layer kind it does not know
    (dict(model_type="llama", layer_types=["linear_attention", "full_attention"] * 2), "kvlab knows the state of "
                                                                                      "qwen3_next, jamba, bamba only"),
    (dict(model_type="qwen3_next", layer_types=["mamba_ssd", "full_attention"] * 2), "a state kvlab does not know"),
    (dict(model_type="mistral", sliding_window=-5), "sliding_window = -5"),
    (dict(model_type="llama4_text", layer_types=["chunked_attention", "full_attention"] * 2), "full and sliding attention only"),
    # found in a later audit: config.json forms that mark layer kinds without layer_types were counted as all-attention
    (dict(model_type="qwen3_next", full_attention_interval=2, head_dim=16, linear_conv_kernel_dim=0),
     "linear_conv_kernel_dim=0 must be a positive integer"),
    (dict(model_type="no_such_arch", sliding_window=8, sliding_window_pattern=2), "sliding_window_pattern mark which "
                                                                                   "layers attend"),
    (dict(model_type="no_such_arch", hybrid_override_pattern="M*M*"), "hybrid_override_pattern mark which layers"),
])
def test_configs_that_would_give_wrong_bytes_are_refused(extra, says):
    with pytest.raises(ValueError, match=says):
        models.from_hf_config({**_BASE, **extra})


def test_gemma3s_sliding_pattern_is_read_as_transformers_reads_it():
    """gemma-3-1b's config.json gives sliding_window_pattern 6 and no layer_types: layers 5, 11, 17 and 23 attend to
    everything, the other 22 keep 512 tokens (an audit found all 26 counted as sliding: 3.3× too few bytes)."""
    from kvlab import calculator

    cfg = dict(model_type="gemma3_text", num_hidden_layers=26, hidden_size=1152, num_attention_heads=4,
               num_key_value_heads=1, head_dim=256, vocab_size=262144, intermediate_size=6912, sliding_window=512)
    for given in ({"sliding_window_pattern": 6}, {}):  # 6 is also transformers' default for Gemma 3
        spec = models.from_hf_config({**cfg, **given})
        assert spec.sliding_layers == tuple(i for i in range(26) if (i + 1) % 6)
        per_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
        assert calculator.kv_cache_bytes(spec, 8192) == per_token * (4 * 8192 + 22 * 512)


@pytest.mark.parametrize("change, says", [
    (dict(kv_heads=3, heads=8), "kv_heads=3 must divide heads=8"),
    (dict(sliding_window=-5, sliding_layers=(0,)), "sliding_window=-5: must be a positive int"),
    (dict(sliding_window=4.5, sliding_layers=(0,)), "sliding_window=4.5"),
    (dict(sliding_layers=(1.5,), sliding_window=8), "not layer indices"),
    (dict(attention="mqa"), "attention='mqa' but kv_heads="),
    (dict(params=-1), "params=-1"),
    (dict(active_params=10 ** 12), "active_params=1000000000000 > params"),
    (dict(intermediate_size=0), "intermediate_size=0"),
    (dict(max_positions=-1), "max_positions=-1"),
])
def test_a_spec_of_an_impossible_shape_is_refused(change, says):
    import dataclasses

    spec = models.get("kvlab-tiny")
    with pytest.raises(ValueError, match=re.escape(says)):
        dataclasses.replace(spec, **change)


@pytest.mark.parametrize("change, says", [
    (dict(kv_lora_rank=512.5), "kv_lora_rank=512.5"),
    (dict(kv_lora_rank=-4), "kv_lora_rank=-4"),
    (dict(qk_rope_head_dim=-600), "qk_rope_head_dim=-600"),
])
def test_an_impossible_mla_spec_is_refused(change, says):
    import dataclasses

    spec = models.get("deepseek-v3")
    with pytest.raises(ValueError, match=re.escape(says)):
        dataclasses.replace(spec, **change)


def test_a_spec_with_more_kv_heads_than_heads_is_refused():
    spec = models.get("kvlab-tiny")
    import dataclasses

    with pytest.raises(ValueError, match="more KV heads than query heads"):
        dataclasses.replace(spec, kv_heads=spec.heads * 2)


def test_yaml_off_in_a_grid_stays_off(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("contexts: [64]\nattribution: [off, auto]\n")
    done = kvlab_command(["sweep", "handoff", "--grid", str(grid), "--dry-run"], _env(tmp_path))
    assert done.returncode == 0 and '"attribution": "off"' in done.stdout and "False" not in done.stdout, done.stdout


def test_a_huge_grid_is_refused_before_it_is_expanded(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("\n".join(f"p{i}: [{', '.join(str(j) for j in range(10))}]" for i in range(7)) + "\n")
    done = kvlab_command(["sweep", "handoff", "--grid", str(grid), "--dry-run"], _env(tmp_path))
    _one_line(done, "has 10,000,000 points")


def test_run_dir_never_overwrites_a_finished_run(tmp_path):
    folder = tmp_path / "done"
    folder.mkdir()
    (folder / "run.json").write_text('{"status": "finished"}')
    done = kvlab_command(["run", "calculator", "--run-dir", str(folder)], _env(tmp_path))
    _one_line(done, "holds a finished run")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _one_line(kvlab_command(["run", "calculator", "--run-dir", str(other)], _env(tmp_path)), "no run.json")
    afile = tmp_path / "file"
    afile.write_text("x")
    _one_line(kvlab_command(["run", "calculator", "--run-dir", str(afile)], _env(tmp_path)), "is a file")


def test_an_os_error_is_one_line(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should go")
    done = kvlab_command(["disagg", "--quiet", "--out", str(blocker / "run")], _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Not a directory" in lines[0], done.stderr


@pytest.mark.parametrize("content, says", [
    (b'{"traceEvents":[{"ph":"X","name":"k","ts":"abc","dur":5,"cat":"kernel","pid":0,"tid":7}]}',
     "a Kineto trace gives both as numbers"),
    (b'{"traceEvents":[{"ph":"X","name":"k","ts":10,"dur":-5,"cat":"kernel","pid":0,"tid":7}]}',
     "negative duration"),
    (b"SQLite format 3\x00" + b"\x00" * 50 + b"garbage" * 100, "cannot be read"),
])
def test_broken_traces_are_one_line(content, says, tmp_path):
    f = tmp_path / ("t.sqlite" if content.startswith(b"SQLite") else "t.json")
    f.write_bytes(content)
    lines = [ln for ln in kvlab_command(["trace", "load", str(f)], _env(tmp_path)).stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], lines


_MLA = dict(model_type="deepseek_v3", num_hidden_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100,
            intermediate_size=128, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def test_mla_is_found_by_its_field_or_family_not_by_a_truthy_width():
    assert models.from_hf_config(_MLA).attention == "mla"
    with pytest.raises(ValueError, match="kv_lora_rank=0 must be a positive integer"):
        models.from_hf_config({**_MLA, "kv_lora_rank": 0})
    with pytest.raises(ValueError, match="missing required field.*kv_lora_rank"):
        models.from_hf_config({**_MLA, "kv_lora_rank": None})
    # another family with the field set is read as MLA too (the field decides), so its missing MLA widths are named
    with pytest.raises(ValueError, match="missing required field.*qk_rope_head_dim"):
        models.from_hf_config({**_BASE, "model_type": "llama", "kv_lora_rank": 0})
    assert models.from_hf_config({**_BASE, "model_type": "llama"}).attention == "gqa"


# --------------------------------------------------------------- found in a later audit (2026-12-01, CPU)


def test_ceilings_never_overwrite_a_finished_run(tmp_path):
    """`kvlab ceilings --run-dir` wrote CPU numbers over a committed H200 run and kept it "finished"."""
    folder = tmp_path / "done"
    folder.mkdir()
    (folder / "run.json").write_text('{"status": "finished"}')
    done = kvlab_command(["ceilings", "--paths", "d2h_pageable", "--sizes", "1M", "--repeats", "3",
                          "--run-dir", str(folder)], _env(tmp_path))
    _one_line(done, "holds a finished run")
    assert (folder / "run.json").read_text() == '{"status": "finished"}'


def test_analyse_never_writes_into_a_folder_that_holds_files(tmp_path):
    """`kvlab analyse RUN --out OTHER_RUN` overwrote the other run's tables."""
    from kvlab import analyse

    run = sorted((Path(__file__).resolve().parent.parent / "data" / "link_ceilings").glob("*-h200"))[-1]
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds files \(a run: it has a run.json\)"):
        analyse.analyse(run, other)
    assert sorted(p.name for p in other.iterdir()) == ["run.json"]


def test_report_check_of_a_file_without_blocks_is_an_error(tmp_path):
    import argparse

    from kvlab import report

    plain = tmp_path / "plain.md"
    plain.write_text("# nothing to check\n")
    with pytest.raises(ValueError, match="has no <!-- kvlab-report:NAME --> blocks"):
        report.run_args(argparse.Namespace(readme=str(plain), check=True))


def test_a_corrupt_run_json_is_named(tmp_path):
    from kvlab import results, runfolder

    bad = tmp_path / "run.json"
    bad.write_text('{"status": "finished",\n')
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}: not valid JSON"):
        paths.read_json(bad)


def test_a_run_that_finishes_in_a_stopped_folder_clears_its_stopped_note(tmp_path):
    """A disagg run into the folder of one that had stopped said "finished" beside the old STOPPED.txt."""
    from kvlab import results, runfolder

    folder = tmp_path / "again"
    folder.mkdir()
    (folder / runfolder.STOPPED).write_text("This run stopped before it finished (Ctrl-C).\n")
    (folder / "bench.csv").write_text("a table of the attempt that stopped\n")
    run = results.start("calculator", {}, folder)
    aside = [p for p in folder.iterdir() if p.name.startswith("stopped-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [runfolder.STOPPED, "bench.csv"]
    assert not (folder / "bench.csv").exists()  # the new run's tables cannot mix with the old attempt's
    run.finish()
    assert not (folder / runfolder.STOPPED).exists() and (folder / "run.json").is_file()


@pytest.mark.parametrize("params, says", [
    ({"tflops": float("nan")}, "tflops = nan: give a float"),  # kvlab.study.check_params refuses a non-finite float
    ({"tflops": -3}, "tflops = -3"),
    ({"ratio_min_tokens": 4096, "ratio_max_tokens": 128}, "ratio_min_tokens = 4096 > ratio_max_tokens = 128"),
])
def test_calculator_values_its_notebook_would_fail_on_are_refused_first(params, says):
    """Found in an audit: `kvlab run calculator -p tflops nan` made a run folder, then failed in cell 3."""
    from kvlab.studies import calculator

    with pytest.raises(ValueError, match=re.escape(says)):
        calculator.check(params)
    calculator.check({"tflops": 400, "ratio_min_tokens": 128, "ratio_max_tokens": 4096})


def test_a_folder_a_live_run_is_writing_is_refused(tmp_path):
    """Found in an audit: two `kvlab disagg --out SAME` runs at once both exited 0, the folder holding only the
    second's run.json and a mix of their worker logs."""
    import json
    import socket
    import subprocess
    import sys

    from kvlab import results, runfolder

    folder = tmp_path / "busy"
    folder.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"status": "running", "pid": live.pid, "host": {"hostname": socket.gethostname()}}
        (folder / "run.json").write_text(json.dumps(record))
        with pytest.raises(ValueError, match=rf"still in progress \(process {live.pid} on this host\)"):
            runfolder.check_run_folder(folder, "--out")
    finally:
        live.kill()
        live.wait()
    runfolder.check_run_folder(folder, "--out")  # its process is gone (killed without a word): the folder may be reused
    run = results.start("calculator", {}, tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / "run.json").read_text())["pid"] == run._record["pid"]


# --------------------------------------------------------------------------------- issue 26: YAML and notebooks


@pytest.mark.parametrize("text, says", [
    ("contexts: [1024]\ncontexts: [4096]\n", "key 'contexts' is given twice"),
    ("a: &x [1, 2]\nb: [*x, *x]\n", "anchors and aliases"),
    ("x: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than"),
    ("x: [1, 2\n", "is not valid YAML"),
])
def test_a_grid_kvlab_cannot_take_is_refused_in_one_line(tmp_path, text, says):
    from kvlab import runner

    grid = tmp_path / "grid.yaml"
    grid.write_text(text)
    with pytest.raises(runner.UsageError, match=says) as err:
        runner.load_grid(grid)
    assert "\n" not in str(err.value) and str(grid) in str(err.value)


def test_a_json_grid_with_a_repeated_key_is_refused(tmp_path):
    from kvlab import runner

    grid = tmp_path / "grid.json"
    grid.write_text('{"policy": ["eager"], "policy": ["deadline"]}')
    with pytest.raises(runner.UsageError, match="key 'policy' is given twice"):
        runner.load_grid(grid)


def test_a_notebook_with_two_parameters_cells_is_refused(tmp_path, make_notebook):
    import nbformat

    from kvlab import params

    nb_path = make_notebook(tmp_path / "02_two.ipynb", 'x: int = 1  # one\nrun_dir: str = ""  # the folder\n')
    nb = nbformat.read(str(nb_path), as_version=4)
    second = nbformat.v4.new_code_cell("x: int = 2  # again")
    second.metadata["tags"] = ["parameters"]
    nb.cells.append(second)
    nbformat.write(nb, str(nb_path))
    with pytest.raises(params.UsageError, match="has 2 cells tagged parameters; a notebook has exactly one"):
        params.notebook_parameters(nb_path)


# --------------------------------------------------------------------------------- issue 26: traces


def _trace(tmp_path, events) -> Path:
    import json as _json

    path = tmp_path / "t.json"
    path.write_text(_json.dumps({"traceEvents": events}))
    return path


def test_a_fifo_or_a_device_is_refused_not_waited_on(tmp_path):
    import os

    from kvlab.tracefmt import TraceError, load_kineto

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for where in (fifo, Path("/dev/zero")):
        with pytest.raises(TraceError, match="is not a regular file"):
            load_kineto(where)


def test_a_gzip_bomb_stops_at_the_limit(tmp_path, monkeypatch):
    import gzip

    from kvlab.tracefmt import TraceError, load_kineto

    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (64 << 20)))  # 64 MiB of spaces in about 64 KiB
    monkeypatch.setenv("KVLAB_MAX_TRACE_BYTES", str(8 << 20))
    with pytest.raises(TraceError, match="inflates to more than 8,388,608 bytes"):
        load_kineto(bomb)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(b'{"traceEvents": []}')[:-6])
    with pytest.raises(TraceError, match="is truncated"):
        load_kineto(cut)


@pytest.mark.parametrize("event, says", [
    ({"ph": "X", "cat": "kernel", "name": "k", "ts": 1e300, "dur": 1}, "beyond any clock"),
    ({"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 1}, "gives both as numbers"),
])
def test_times_no_clock_can_hold_are_named(tmp_path, event, says):
    from kvlab.tracefmt import TraceError, load_kineto

    with pytest.raises(TraceError, match=says):
        load_kineto(_trace(tmp_path, [event]))


def test_a_list_for_args_and_deep_nesting_do_not_crash(tmp_path):
    from kvlab.tracefmt import TraceError, load_kineto

    ok = load_kineto(_trace(tmp_path, [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2, "args": [1, 2]}]))
    assert len(ok) == 1
    deep = tmp_path / "deep.json"
    deep.write_text('{"traceEvents": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(TraceError, match="nests too deep|not a Kineto"):
        load_kineto(deep)


# --------------------------------------------------------------------------------- issue 26: config.json


@pytest.mark.parametrize("change, says", [
    ({"intermediate_size": 1.5}, "intermediate_size=1.5 must be a positive integer"),
    ({"intermediate_size": True}, "intermediate_size=True must be a positive integer"),
    ({"intermediate_size": 0}, "intermediate_size=0 must be a positive integer"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no' must be true or false"),
    ({"model_type": ["qwen2"]}, "model_type=\\['qwen2'\\] must be a string"),
    ({"rms_norm_eps": -1}, "rms_norm_eps=-1 must be a number in \\(0, 1\\)"),
    ({"max_position_embeddings": 1e400}, "max_position_embeddings=inf must be a positive integer"),
    ({"num_hidden_layers": float("inf")}, "num_hidden_layers=inf must be a positive integer"),
])
def test_a_config_value_kvlab_would_misread_is_refused_by_name(tmp_path, change, says):
    import json as _json

    from kvlab import models

    cfg = dict(models.get("kvlab-tiny").hf_config, **change)
    path = tmp_path / "config.json"
    path.write_text(_json.dumps(cfg))  # Infinity as JSON writes it
    with pytest.raises(ValueError, match=says):
        models.from_hf_config(path)


def test_a_config_nested_past_any_config_is_refused(tmp_path):
    from kvlab import models

    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen2", "x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ValueError, match="cannot be read as a config"):
        models.from_hf_config(path)


# --------------------------------------------------------------------------------- issue 26: checked before a folder


@pytest.mark.parametrize("change, says", [
    ({"seed": 2**64}, "seed = 18446744073709551616: give an int ≥ 0 and ≤ 4,294,967,295"),
    ({"decode_tokens": 10**9}, "decode-tokens = 1000000000: give an int ≥ 1 and ≤ 4,096"),
    ({"weights": "nobody/no-such-model-kvlab"}, "not in this machine's Hugging Face cache"),
    ({"repeats": 10**8}, "repeats = 100000000: give an int ≥ 1 and ≤ 10,000,000"),
])
def test_disagg_values_that_would_fail_in_the_workers_are_refused_first(change, says, tmp_path):
    from kvlab import disagg

    with pytest.raises(ValueError, match=says):
        disagg.check(disagg.DisaggConfig(**change))
    assert not (tmp_path / "data").exists()
