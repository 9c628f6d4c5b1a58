"""Every command README shows and every `Example:` line of `kvlab … --help` runs as written, on this machine
(issue 13). A command marked `GPU`, `2 GPUs` or `nsys` in its README comment must, where that is missing, be
refused with one line and no traceback, before it writes anything."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest

from conftest import REPO, kvlab_command
from conftest import cpu_env as _env

README = REPO / "README.md"


def _readme_commands() -> list[tuple[str, str]]:
    """(command, comment) of each line of README's `kvlab` command block."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## The `kvlab` command", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    out = []
    for line in block.strip().splitlines():
        command, _, comment = line.partition(" #")
        if command.startswith("source "):  # the venv's activation, the block's first line: test_the_venv_line
            continue
        out.append((command.strip(), comment.strip()))
    return out


def test_the_command_blocks_venv_line_names_what_make_builds():
    """The block starts by activating the venv `make` builds; the commands after it need kvlab on PATH."""
    section = README.read_text(encoding="utf-8").split("## The `kvlab` command", 1)[1]
    first = section.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()[0]
    assert first.split(" #")[0].strip() == "source .venv/bin/activate", first
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^VENV\s*\??[:]?=\s*\.venv\s*$", makefile, re.M), "the Makefile builds its venv elsewhere"
    venv = REPO / ".venv"
    if venv.is_dir():  # after `make test`: the file the line sources, and the kvlab it puts on PATH
        assert (venv / "bin" / "activate").is_file() and (venv / "bin" / "kvlab").is_file()


def _help_examples() -> list[str]:
    """Every `Example: kvlab …` line of every subcommand's --help (and `kvlab trace load/nsys --help`), read in
    this process (collection must stay fast); test_every_help_text_prints shows them as a user would."""
    import contextlib
    import io

    from kvlab import cli
    from kvlab.tracefmt import command

    found = []
    for argv in [[c, "--help"] for c in cli.command_names()] + [["trace", "load", "--help"],
                                                                  ["trace", "nsys", "--help"]]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            if argv[0] == "trace" and len(argv) == 3:
                command.trace_main(argv[1:])
            else:
                cli.main(argv)
        found += re.findall(r"^\s*Example: (kvlab .+?)\s*$", out.getvalue(), re.M)
    return found


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["trace", "load", "--help"]])
def test_every_help_text_prints(argv):
    done = kvlab_command(argv)
    assert done.returncode == 0 and "usage: kvlab" in done.stdout, done.stderr


def _needs(comment: str) -> str | None:
    """What a README command needs beyond a CPU, from its comment's first word(s)."""
    for tag in ("2 GPUs", "GPU", "nsys"):
        if comment.startswith(tag + ":") or comment.startswith(tag + " "):
            return tag
    return None


def _have(need: str) -> bool:
    if need == "nsys":
        return shutil.which("nsys") is not None
    import torch

    return torch.cuda.device_count() >= (2 if need == "2 GPUs" else 1)


README_COMMANDS = _readme_commands()


def test_readme_shows_the_commands_this_test_runs():
    assert len(README_COMMANDS) >= 10
    assert all(c.startswith("kvlab ") for c, _ in README_COMMANDS), README_COMMANDS


def _fresh_outputs(argv: list[str]) -> None:
    """An example that writes to a fixed folder under /tmp (`--out /tmp/kvlab-disagg`, `--run-dir`) refuses to overwrite a
    finished run, as it should: clear what an earlier run of this very example left there, so it runs as written."""
    import os

    for flag, value in zip(argv, argv[1:]):
        if flag in ("--out", "--run-dir") and os.path.realpath(value).startswith("/tmp/") and os.path.isdir(value):
            shutil.rmtree(value, ignore_errors=True)


@pytest.mark.parametrize("command, comment", README_COMMANDS, ids=[c for c, _ in README_COMMANDS])
def test_each_readme_command_runs_as_written(command, comment, tmp_path, workbook):
    argv = shlex.split(command)[1:]
    need = _needs(comment)
    if argv == ["run-all"]:  # the session's `workbook` fixture ran exactly this
        assert workbook.process.returncode == 0, workbook.process.stderr[-2000:]
        return
    if need and _have(need):
        pytest.skip(f"{command!r} is a measurement on {need}; the GPU sessions run it")
    _fresh_outputs(argv)
    done = kvlab_command(argv, _env(tmp_path))
    if need:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        assert done.returncode in (2, 3), f"{command!r} needs {need} but exited {done.returncode}"
        assert len(lines) == 1 and "Traceback" not in done.stderr, f"{command!r}: not one line: {done.stderr}"
        assert not (tmp_path / "data").exists(), f"{command!r} wrote a run folder before refusing"
        return
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr


HELP_EXAMPLES = _help_examples()


def test_help_has_examples():
    assert len(HELP_EXAMPLES) >= 4, HELP_EXAMPLES


@pytest.mark.parametrize("command", HELP_EXAMPLES)
def test_each_help_example_runs_as_written(command, tmp_path):
    _fresh_outputs(shlex.split(command)[1:])
    done = kvlab_command(shlex.split(command)[1:], _env(tmp_path))
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


@pytest.mark.parametrize("argv, says", [
    (["run", "handoff", "-p", "contexts", "[1024"], "-p contexts '[1024' is not valid YAML"),
    (["run", "handoff", "-p", "contexts", "1024,4O96"], "'4O96' is not a token count"),
    (["run", "handoff", "-p", "model", "qwen2.5-7"], "did you mean 'qwen2.5-7b'"),
    (["run", "paged_transfer", "-p", "methods", "trition"], "did you mean 'triton'"),
    (["run", "handoff", "-p", "policy", "deadline", "-p", "destinations", "same-gpu,pageable"], "cannot send to"),
    (["calc", "llama-3.1-8", "--tokens", "8192"], "did you mean 'llama-3.1-8b'"),
    (["calc", "llama-3.1-8b", "--tokens", "8192", "--link", "100"], "has no unit"),
])
def test_bad_values_are_refused_in_one_line_before_anything_runs(argv, says, tmp_path):
    done = kvlab_command(argv, _env(tmp_path))
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert not (tmp_path / "data").exists()
