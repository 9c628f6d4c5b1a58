"""The kvlab command: help, notebook parameters and their validation, run / run-all / sweep through
papermill on a throwaway notebook, calc, info; and the packaging a user meets first (the console
script, environment.yml in step with pyproject.toml, the Makefile's TORCH)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvlab import cli, results, runfolder, runner
from kvlab import params as nbparams

REPO = Path(__file__).resolve().parent.parent


def kvlab(*argv: str) -> int:
    return cli.main(list(argv))


def created(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*")) if folder.exists() else []


# ------------------------------------------------------------------------------------ help


@pytest.mark.parametrize("command", cli.command_names())
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        kvlab(command, "--help")
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvlab {command}")
    assert len(out.splitlines()) > 4


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        kvlab("--help")
    out = capsys.readouterr().out
    for command in ("run", "run-all", "sweep", "calc", "info"):
        assert f"    {command} " in out


@pytest.mark.parametrize("argv, says", [
    (["disagg", "--contxt", "1k"], "kvlab disagg: error: unrecognized arguments: --contxt 1k; did you mean --context?"),
    (["disag"], "invalid choice: 'disag'"),
    (["disag"], "did you mean 'disagg'?"),
    (["disagg", "--repeats", "x"], "kvlab disagg: error: argument --repeats: invalid int value: 'x'"),
    (["calc", "qwen2.5-7b", "--tokens", "1k", "--zzz"], "unrecognized arguments: --zzz (kvlab calc -h"),
    # after "--" nothing is an option, so nothing is suggested; before the command, kvlab's own parser answers
    (["calc", "qwen2.5-7b", "--tokens", "1k", "--", "x"], "unrecognized arguments: -- x (kvlab calc -h"),
    (["--verison", "info"], "kvlab: error: unrecognized arguments: --verison; did you mean --version?"),
    (["info", "--version"], "--version is kvlab's own option, before any command"),
])
def test_a_mistyped_command_line_is_one_line_with_a_suggestion_not_the_usage_block(argv, says, capsys):
    with pytest.raises(SystemExit) as done:
        kvlab(*argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert done.value.code == 2 and len(lines) == 1 and says in lines[0], err
    assert "usage:" not in err


def test_kvlab_trace_s_own_parser_errs_in_one_line_too(capsys):
    assert kvlab("trace", "lod", "x") == 2  # trace_main returns argparse's exit code
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "kvlab trace: error: argument what: invalid choice: 'lod'" in lines[0], lines


def test_python_dash_m_and_the_console_script_reach_main():
    done = subprocess.run([sys.executable, "-m", "kvlab", "--help"], capture_output=True,
                          text=True, check=False, cwd=REPO)
    assert done.returncode == 0 and "run-all" in done.stdout
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvlab"] == "kvlab.cli:main"


def test_a_subcommand_is_one_function_and_one_registration(capsys):
    @cli.subcommand("hello", "say hello", cli.arg("--name", default="world"))
    def _hello(args) -> int:
        """Say hello."""
        print(f"hello {args.name}")
        return 0

    try:
        assert kvlab("hello", "--name", "kv") == 0
        assert capsys.readouterr().out == "hello kv\n"
        with pytest.raises(ValueError, match="twice"):
            cli.subcommand("hello", "again")(_hello)
    finally:
        cli._COMMANDS[:] = [c for c in cli._COMMANDS if c.name != "hello"]


def test_a_module_can_configure_its_own_options_lazily(tmp_path, monkeypatch, capsys):
    (tmp_path / "kvlab_fake_plugin.py").write_text(
        "def add_arguments(parser):\n"
        "    parser.add_argument('--sizes', nargs='+', default=['auto'])\n"
        "    return parser\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvlab_fake_plugin", raising=False)

    @cli.subcommand("plugin", "options from a module", configure="kvlab_fake_plugin:add_arguments")
    def _plugin(args) -> int:
        print(" ".join(args.sizes))
        return 0

    @cli.subcommand("broken", "its module does not exist", configure="kvlab_no_such_module:f")
    def _broken(args) -> int:
        return 0

    try:
        assert kvlab("info") == 0  # neither module is imported for another subcommand
        assert "kvlab_fake_plugin" not in sys.modules
        capsys.readouterr()
        assert kvlab("plugin", "--sizes", "4K", "1M") == 0
        assert capsys.readouterr().out == "4K 1M\n"
        with pytest.raises(ModuleNotFoundError):
            kvlab("broken")
    finally:
        cli._COMMANDS[:] = [c for c in cli._COMMANDS if c.name not in ("plugin", "broken")]


# -------------------------------------------------------------------- notebook parameters


CELL = '''\
model: str = "auto"  # model name, or "auto"
size: int | str = "auto"  # tokens, or "auto" (papermill's own inspector drops this line)
contexts: list[int] = [
    1024,
    4096,
]  # prompt lengths, tokens
dtype: Literal["bf16", "fp8"] = "bf16"  # KV dtype
maybe: Optional[float] = None  # a fraction, or None
plain = 3
run_dir: str = ""  # kvlab run sets it; empty = a new data/<study>/<run_id>/
'''


def test_parameter_cell_parsing_keeps_unions_comments_and_multiline_values():
    params = nbparams.parse_parameter_cell(CELL)
    assert list(params) == ["model", "size", "contexts", "dtype", "maybe", "plain", "run_dir"]
    assert params["size"] == nbparams.Parameter("size", "int | str", '"auto"',
                                           'tokens, or "auto" (papermill\'s own inspector drops '
                                           'this line)')
    assert ast.literal_eval(params["contexts"].default) == [1024, 4096]
    assert params["contexts"].help == "prompt lengths, tokens"
    assert params["plain"].annotation is None and params["plain"].help == ""
    assert params["run_dir"].default == '""'
    with pytest.raises(cli.UsageError, match="not valid Python"):
        nbparams.parse_parameter_cell("x: int = (")


@pytest.mark.parametrize("name, raw, value", [
    ("size", "4096", 4096), ("size", "auto", "auto"), ("contexts", "[1024, 4096]", [1024, 4096]),
    ("model", "400", "400"), ("dtype", "fp8", "fp8"), ("maybe", "1e-3", 0.001),
    ("maybe", "null", None), ("maybe", "2", 2), ("plain", "[1, {a: 2}]", [1, {"a": 2}]),
])
def test_values_are_yaml_checked_against_annotations(name, raw, value):
    declared = nbparams.parse_parameter_cell(CELL)
    got = nbparams.parse_params([(name, raw)], declared, "nb")[name]
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("name, raw, match", [
    ("contexts", "1024", r"list\[int\]"), ("dtype", "fp4", "Literal"),
    ("maybe", "lots", r"Optional\[float\]"), ("size", "[1]", "int | str"),
    ("contexts", "[1, 2", "not valid YAML"), ("sise", "3", "unknown parameter 'sise' for nb"),
    ("run_dir", "/tmp/x", "--run-dir"),
])
def test_bad_values_and_names_are_refused(name, raw, match):
    declared = nbparams.parse_parameter_cell(CELL)
    with pytest.raises(cli.UsageError, match=match):
        nbparams.parse_params([(name, raw)], declared, "nb")


def test_bool_is_not_a_number():
    declared = nbparams.parse_parameter_cell("n: int = 1  # count\n")
    with pytest.raises(cli.UsageError, match="n = True"):
        nbparams.parse_params([("n", "true")], declared, "nb")


# --------------------------------------------------------------------- finding notebooks


def test_notebooks_are_found_by_path_stem_study_or_number(toy_project, make_notebook, tmp_path):
    toy = toy_project / "notebooks" / "00_toy.ipynb"
    for ref in ("toy", "00_toy", "00_toy.ipynb", "0", "00", str(toy)):
        assert nbparams.find_notebook(ref) == toy, ref
    with pytest.raises(cli.UsageError, match=r"known: 00_toy \(toy\)"):
        nbparams.find_notebook("handoff")
    with pytest.raises(cli.UsageError, match="does not exist"):
        nbparams.find_notebook(str(tmp_path / "missing.ipynb"))
    make_notebook(toy_project / "notebooks" / "00_other.ipynb", "run_dir: str = ''  # x\n")
    with pytest.raises(cli.UsageError, match="ambiguous"):
        nbparams.find_notebook("00")


# ------------------------------------------------------------------ refusing before writing


def test_unknown_parameter_lists_valid_names_and_creates_nothing(toy_project, kvlab_dirs,
                                                                  capsys):
    assert kvlab("run", "toy", "-p", "sise", "3") == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'sise' for 00_toy.ipynb; valid parameters:" in err
    for line in ("size: int = 3  # rows in the table", "contexts: list[int] = [1, 2]",
                 'mode: int | str = "auto"  # "auto" or a number', 'label: str = "x"'):
        assert line in err
    assert created(kvlab_dirs.data) == []


def test_wrong_type_and_run_dir_are_refused_before_writing(toy_project, kvlab_dirs, capsys):
    assert kvlab("run", "toy", "-p", "size", "4k") == 2
    assert "size = '4k' (str) does not fit its declared type int" in capsys.readouterr().err
    assert kvlab("run", "toy", "-p", "run_dir", "/tmp/x") == 2
    assert "--run-dir" in capsys.readouterr().err
    assert created(kvlab_dirs.data) == []


def test_a_notebook_without_run_dir_is_refused(tmp_path, make_notebook, kvlab_dirs, capsys):
    nb = make_notebook(tmp_path / "lonely.ipynb", "n: int = 1  # count\n", "print(n)")
    assert kvlab("run", str(nb)) == 2
    assert 'run_dir: str = ""' in capsys.readouterr().err
    assert created(kvlab_dirs.data) == []


# ---------------------------------------------------------------- executing (real kernels)


def test_run_executes_into_a_new_run_folder(toy_project, kvlab_dirs, capsys):
    rc = kvlab("run", "toy", "--no-progress", "-p", "contexts", "[1024, 4096]", "-p", "scale",
               "1e3", "-p", "label", "400", "-p", "mode", "7")
    out = capsys.readouterr().out
    assert rc == 0, out
    run_dir = Path(out.strip().splitlines()[-1])
    assert run_dir.parent == kvlab_dirs.data / "toy"
    assert (run_dir / "00_toy.ipynb").is_file()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished"
    assert record["parameters"] == {"size": 3, "scale": 1000.0, "label": "400",
                                    "contexts": [1024, 4096], "mode": 7}
    assert record["argv"][:3] == ["kvlab", "run", "toy"]
    assert record["invocation"]["command"] == "run"
    assert record["execution"]["ok"] is True
    assert record["interactive"] is False  # the kernel knew it ran in batch
    executed = json.loads((run_dir / "00_toy.ipynb").read_text())
    assert executed["metadata"]["papermill"]["parameters"]["run_dir"] == str(run_dir)
    assert os.environ.get("KVLAB_BATCH") is None  # nothing leaked into this process


def test_failed_notebook_exits_nonzero_and_keeps_the_partial_notebook(toy_project, kvlab_dirs,
                                                                        tmp_path, capsys):
    chosen = tmp_path / "mine" / "20260101-000000-cpu"
    rc = kvlab("run", "toy", "--no-progress", "-p", "size", "13", "--run-dir", str(chosen))
    captured = capsys.readouterr()
    assert rc == 1
    assert "size 13 fails on purpose" in captured.err
    assert captured.out.strip().splitlines()[-1] == str(chosen)
    assert (chosen / "00_toy.ipynb").is_file()
    record = json.loads((chosen / "run.json").read_text())
    assert record["status"] == "failed" and "fails on purpose" in record["execution"]["error"]
    assert results.runs("toy") == []  # a failed run is not a result


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_during_a_notebook_leaves_a_run_that_says_it_stopped(tmp_path, make_notebook, signals):
    """`timeout` ends `kvlab run` with SIGTERM (and then its process group): the run folder must say it stopped.
    On the H200 (2026-12-01) a notebook killed this way left run.json saying "running", which looks like a run
    still going rather than one that ended."""
    import signal
    import time

    root = tmp_path / "project"
    make_notebook(root / "notebooks" / "00_slow.ipynb", 'run_dir: str = ""  # set by kvlab run\n',
                  "import time\nfrom kvlab import results\nrun = results.start('slow', {}, run_dir=run_dir)\n"
                  "time.sleep(300)\nrun.finish()")
    chosen = tmp_path / "runs" / "20260101-000000-cpu"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_")}
    env.update(KVLAB_ROOT=str(root), KVLAB_DATA=str(tmp_path / "data"), KVLAB_FIGURES=str(tmp_path / "figures"),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    p = subprocess.Popen([sys.executable, "-m", "kvlab", "run", "slow", "--no-progress", "--run-dir", str(chosen)],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the notebook has started its run
            if (chosen / "run.json").is_file() and json.loads((chosen / "run.json").read_text())["status"] == "running":
                break
            time.sleep(0.2)
        else:
            pytest.fail("the notebook never started its run")
        for _ in range(signals):
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    record = json.loads((chosen / "run.json").read_text())
    assert p.returncode == 143, err
    assert "terminated (SIGTERM)" in err and f"{chosen} says it stopped (STOPPED.txt)" in err
    assert record["status"] == "failed" and record["execution"]["error"] == "terminated (SIGTERM)"
    assert "SIGTERM" in (chosen / runfolder.STOPPED).read_text()


def test_run_all_continues_after_a_failure_and_fails_at_the_end(toy_project, make_notebook,
                                                                 kvlab_dirs, capsys):
    make_notebook(toy_project / "notebooks" / "01_broken.ipynb",
                  'run_dir: str = ""  # kvlab run sets it\n', "raise ValueError('broken')")
    make_notebook(toy_project / "notebooks" / "02_after.ipynb",
                  'size: int = 1  # rows\nrun_dir: str = ""  # kvlab run sets it\n',
                  "from kvlab import results\n"
                  "results.start('after', {'size': size}, run_dir).finish()")
    # -p goes to every notebook declaring it; 01_broken does not declare size.
    rc = kvlab("run-all", "--no-progress", "-p", "size", "2")
    out = capsys.readouterr().out
    assert rc == 1
    table = out[out.index("notebook"):].splitlines()
    assert [line.split()[:2] for line in table[2:]] == [
        ["00_toy.ipynb", "ok"], ["01_broken.ipynb", "FAILED"], ["02_after.ipynb", "ok"]]
    assert json.loads(next((kvlab_dirs.data / "after").glob("*/run.json")).read_text())[
        "parameters"] == {"size": 2}
    assert json.loads(next((kvlab_dirs.data / "toy").glob("*/run.json")).read_text())[
        "parameters"]["size"] == 2


def test_a_cell_past_the_cell_timeout_fails_the_run_instead_of_hanging(toy_project, make_notebook, kvlab_dirs,
                                                                        capsys):
    import time

    make_notebook(toy_project / "notebooks" / "01_slow.ipynb", 'run_dir: str = ""  # kvlab run sets it\n',
                  "from kvlab import results\nrun = results.start('slow', {}, run_dir)", "import time\ntime.sleep(120)")
    t0 = time.monotonic()
    # 10 s, not less: the first cell (importing kvlab) took over 3 s once on a busy 2-CPU machine, and with no
    # run folder started the record below was missing
    assert kvlab("run", "slow", "--no-progress", "--cell-timeout", "10") == 1
    assert time.monotonic() - t0 < 90
    err = capsys.readouterr().err
    assert "longer than the cell timeout (10 s)" in err
    record = json.loads(next((kvlab_dirs.data / "slow").glob("*/run.json")).read_text())
    assert record["status"] == "failed" and "cell timeout" in record["execution"]["error"]


def test_a_fractional_cell_timeout_is_whole_seconds_for_papermill(monkeypatch):
    from kvlab import nbexec

    seen = {}
    monkeypatch.setattr(nbexec, "execute_notebook", lambda *a, **kw: seen.update(kw))
    nb = cli.find_notebook("calculator")
    runner.execute(nb, {}, run_dir=None, progress=False, cell_timeout=2.5)
    assert seen["execution_timeout"] == 3  # nbclient's timeout is an Integer trait: 2.5 would be refused


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_bad_cell_timeout_is_one_line_before_anything_runs(toy_project, kvlab_dirs, capsys, monkeypatch, value):
    assert kvlab("run", "toy", "--cell-timeout", value) == 2
    assert f"--cell-timeout = {value!r}: give a number of seconds > 0" in capsys.readouterr().err
    monkeypatch.setenv("KVLAB_CELL_TIMEOUT", value)
    assert kvlab("run-all") == 2
    assert f"KVLAB_CELL_TIMEOUT = {value!r}" in capsys.readouterr().err
    assert created(kvlab_dirs.data) == []


def test_run_all_refuses_a_name_no_notebook_declares(toy_project, kvlab_dirs, capsys):
    assert kvlab("run-all", "-p", "nope", "1") == 2
    err = capsys.readouterr().err
    assert "no notebook declares 'nope'" in err
    assert "00_toy.ipynb: size, scale, label, contexts, mode" in err
    assert kvlab("run-all", "-p", "run_dir", "/tmp") == 2
    assert "--run-dir" in capsys.readouterr().err
    assert created(kvlab_dirs.data) == []


# ------------------------------------------------------------------------------------ sweep


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("grid, match", [
    ("- {size: 2}\n- {sise: 3}\n- {size: big}\n", r"point 1 .*'sise'(.|\n)*point 2 .*'big'"),
    ("size: 4\n", r"'size' must map to a non-empty list.*size: \[4\]"),
    ("size: []\n", "non-empty list"),
    ("{}\n", "empty"),
    ("[]\n", "empty list"),
    ("- 3\n", "not a mapping"),
    ("just text\n", "holds str"),
    ("size: [1, 2\n", "is not valid YAML"),
    ("- {run_dir: /tmp}\n", "--run-dir"),
])
def test_sweep_validates_every_point_before_running(toy_project, kvlab_dirs, tmp_path, capsys,
                                                    grid, match):
    path = write(tmp_path / "grid.yaml", grid)
    assert kvlab("sweep", "toy", "--grid", str(path)) == 2
    assert re.search(match, capsys.readouterr().err)
    assert created(kvlab_dirs.data) == []


def test_sweep_grid_is_a_cartesian_product_or_a_list(tmp_path):
    product = runner.load_grid(write(tmp_path / "g.yaml", "size: [2, 3]\ncontexts: [[1], [1, 2]]\n"))
    assert product == [{"size": 2, "contexts": [1]}, {"size": 2, "contexts": [1, 2]},
                       {"size": 3, "contexts": [1]}, {"size": 3, "contexts": [1, 2]}]
    listed = runner.load_grid(write(tmp_path / "g.json", json.dumps([{"size": 2}, {}])))
    assert listed == [{"size": 2}, {}]
    with pytest.raises(cli.UsageError, match="does not exist"):
        runner.load_grid(tmp_path / "missing.yaml")


def test_sweep_dry_run_lists_points_and_runs_nothing(toy_project, kvlab_dirs, tmp_path, capsys):
    path = write(tmp_path / "grid.yaml", "size: [2, 3]\nmode: [auto, 5]\n")
    assert kvlab("sweep", "toy", "--grid", str(path), "--dry-run") == 0
    out = capsys.readouterr().out
    assert "4 point(s)" in out and '{"size": 3, "mode": 5}' in out
    assert created(kvlab_dirs.data) == []


def test_sweep_runs_one_run_per_point(toy_project, kvlab_dirs, tmp_path, capsys):
    path = write(tmp_path / "grid.json", json.dumps({"size": [1, 2]}))
    assert kvlab("sweep", "toy", "--grid", str(path), "-p", "label", "swept",
                 "--no-progress") == 0
    out = capsys.readouterr().out
    assert out.count(" ok ") == 2
    records = [json.loads(p.read_text()) for p in (kvlab_dirs.data / "toy").glob("*/run.json")]
    assert sorted(r["parameters"]["size"] for r in records) == [1, 2]
    assert {r["parameters"]["label"] for r in records} == {"swept"}
    assert sorted(r["invocation"]["point"] for r in records) == [0, 1]


# --------------------------------------------------------------------------- calc and info


def test_calc_prints_the_calculator_answer(capsys):
    assert kvlab("calc", "llama-2-7b", "--tokens", "8192", "--link", "100G") == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["kv_bytes_per_token"] == "524,288 (512 KiB) at this prompt"
    assert rows["kv_bytes_per_token_uncapped"] == "524,288 (512 KiB)"
    assert rows["kv_bytes"] == "4,294,967,296 (4 GiB)" and rows["state_bytes"] == "0"
    assert rows["link"] == "100G" and rows["link_bound"] == "True"
    assert kvlab("calc", "llama-3.1-8b", "--tokens", "8192", "--kv-dtype", "fp8", "--tp", "2",
                 "--tflops", "300") == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["kv_bytes_per_token"] == "65,536 (64 KiB) at this prompt"
    assert rows["kv_bytes_per_gpu"] == "268,435,456 (256 MiB)"
    assert rows["tp"] == "2"
    # a sliding-window model at 8k: a token costs about half the uncapped figure; a hybrid's state has its row
    assert kvlab("calc", "gpt-oss-20b", "--tokens", "8k") == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert (rows["kv_bytes_per_token"], rows["kv_bytes_per_token_uncapped"]) == (
        "24,960 (24.38 KiB) at this prompt", "49,152 (48 KiB)")
    assert kvlab("calc", "qwen3-next-80b-a3b", "--tokens", "8k") == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["state_bytes"] == "77,856,768 (74.25 MiB)"


def test_calc_says_when_a_prompt_is_longer_than_the_model_holds(capsys):
    """Issue 26: 10^23 tokens of a 131,072-position model is arithmetic, and the answer says so on its own line."""
    assert kvlab("calc", "llama-3.1-8b", "--tokens", "100000000000000000000000") == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert "more than llama-3.1-8b's 131,072 positions" in rows["positions"] and "arithmetic only" in rows["positions"]
    assert kvlab("calc", "llama-3.1-8b", "--tokens", "8k") == 0
    assert "positions" not in dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("argv, match", [
    (["llama-9", "--tokens", "8"], "known models"),
    (["llama-2-7b", "--tokens", "0"], "tokens"),
    (["llama-2-7b", "--tokens", "8", "--kv-dtype", "fp7"], "fp7"),
    (["llama-2-7b", "--tokens", "8", "--link=-5G"], "-5G"),
    (["llama-2-7b", "--tokens", "8", "--tp", "3"], "32 query heads do not split over 3 ranks"),
    # issue 26: no answer for a TP that engines refuse
    (["llama-3.1-8b", "--tokens", "8k", "--tp", "1000000"], "32 query heads do not split over 1,000,000"),
    (["qwen2.5-7b", "--tokens", "8k", "--tp", "8"], "28 query heads do not split over 8 ranks"),
    (["qwen2.5-7b", "--tokens", "8k", "--tp", "0"], "--tp 0: give a TP degree ≥ 1"),
    (["qwen2.5-7b", "--tokens", "8k", "--tp", "-3"], "--tp -3: give a TP degree ≥ 1"),
])
def test_calc_bad_input_is_a_clear_error(argv, match, capsys):
    assert kvlab("calc", *argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab calc: error:") and match in err


def test_info_runs(capsys):
    assert kvlab("info") == 0
    out = capsys.readouterr().out
    assert "versions" in out and "torch" in out and "device" in out
    assert kvlab("info", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert {"host", "devices", "p2p", "driver_version", "cuda_runtime", "versions"} <= set(info)


def test_info_prints_the_p2p_matrix():
    fake = {"host": {"hostname": "n", "os": "Linux", "cpu_model": "c", "cpu_count": 8,
                     "cpu_usable": 8, "memory_bytes": 2**30},
            "device_kind": "cuda", "device_tag": "h100", "driver_version": "1", "cuda_runtime": "2",
            "devices": [{"index": i, "name": "NVIDIA H100", "memory_bytes": 80 * 2**30,
                         "compute_capability": "9.0", "sm_count": 132} for i in range(2)],
            "p2p": [[None, True], [False, None]], "versions": {"torch": "2.11"}}
    text = cli.format_info(fake)
    assert "    0   1" in text
    assert "    0   -   Y" in text and "    1   .   -" in text
    assert "80 GiB" in text
    assert "topology" not in text  # none recorded
    fake["topology"] = {"matrix": "\tGPU0\tGPU1\nGPU0\t X \tNV18", "nvlink": None}
    text = cli.format_info(fake)
    assert "topology (nvidia-smi topo -m)" in text and "NV18" in text and "NVLink (" not in text


def test_topology_asks_nvidia_smi_only_with_two_gpus(tmp_path, monkeypatch):
    from kvlab import devices

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nif [ \"$1\" = topo ]; then printf 'GPU0 X NV18\\n'; else exit 3; fi\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert devices.topology(1) is None
    assert devices.topology(2) == {"matrix": "GPU0 X NV18", "nvlink": None}
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert devices.topology(2) is None


# -------------------------------------------------------------------------------- packaging


def _requirements(specs) -> dict:
    from packaging.requirements import Requirement

    found = {}
    for spec in specs:
        req = Requirement(spec)
        found[req.name.lower()] = (str(req.specifier), str(req.marker or ""))
    return found


def test_environment_yml_has_the_dependencies_of_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = _requirements(project["dependencies"] + project["optional-dependencies"]["dev"])
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    have = _requirements([d.replace("pytorch", "torch", 1) for d in conda
                          if not d.startswith(("python", "pip"))])
    have.update(_requirements([p for p in pip if not p.startswith("-")]))
    assert have == wanted
    python = next(d for d in conda if d.startswith("python"))
    assert python == "python>=3.11,<3.13"


def test_make_takes_torch_from_the_environment():
    env = {**os.environ, "TORCH": "torch==9.9.9"}
    plan = subprocess.run(["make", "-n", "-B", "venv"], cwd=REPO, env=env, capture_output=True,
                          text=True, check=True).stdout
    lines = plan.splitlines()
    torch_line = lines.index('.venv/bin/python -m pip install "torch==9.9.9"')
    assert lines[torch_line + 1] == ".venv/bin/python -m pip install -e '.[dev]'"
    cpu = subprocess.run(["make", "-n", "-B", "venv", "CPU=1"], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert '.venv/bin/python -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==9.9.9"' in cpu
    wheels = subprocess.run(["make", "-n", "-B", "wheelhouse", "PY_VERSION=3.11"], cwd=REPO,
                            env=env, capture_output=True, text=True, check=True).stdout
    assert "pip wheel --no-deps --wheel-dir wheelhouse ." in wheels
    assert '--python-version 3.11 --platform manylinux_2_28_x86_64 ' in wheels
    assert '"torch==9.9.9" "$(ls wheelhouse/kvlab-*.whl)"' in wheels


def test_wheelhouse_platforms_include_older_glibc_tags():
    # pip takes --platform literally; most wheels are tagged manylinux2014 (glibc 2.17).
    flags = subprocess.run(["make", "-s", "platform-flags", "PLATFORM=manylinux_2_28_x86_64"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    tags = flags[1::2]
    assert flags[::2] == ["--platform"] * len(tags)
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert not any("2_29" in t for t in tags)
    other = subprocess.run(["make", "-s", "platform-flags", "PLATFORM=macosx_11_0_arm64"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert other == ["--platform", "macosx_11_0_arm64"]


def test_ceilings_measures_the_host_path_and_writes_a_run(kvlab_dirs, capsys):
    assert kvlab("ceilings", "--paths", "h2h", "--sizes", "4K", "64K", "-n", "3", "--warmup", "1",
                 "--device", "cpu") == 0
    out = capsys.readouterr().out
    assert "h2h" in out
    run_dirs = list((kvlab_dirs.data / "link_ceilings").iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / "run.json").is_file()


def test_trace_load_refuses_a_file_that_is_not_a_trace(tmp_path, capsys):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("not a trace\n")
    assert kvlab("trace", "load", str(bogus)) == 2
    assert "not JSON" in capsys.readouterr().err
