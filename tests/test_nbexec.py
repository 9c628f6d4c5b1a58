"""kvlab.nbexec: kernel waits in slices, so a ZeroMQ wake-up that never comes costs one slice, not for ever."""

from __future__ import annotations

import asyncio
import time
from queue import Empty

import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from kvlab import nbexec


class _MissedWakeups:
    """Stands in for jupyter_client's get_msg over a socket whose wake-up is lost: a message that is there is only
    seen when the poll's own timeout ends (as pyzmq's poll then checks once more); with no timeout it never is."""

    def __init__(self, message=None):
        self.message, self.calls = message, 0

    async def get_msg(self, timeout=None):  # patched onto the class as a bound method: no channel argument
        self.calls += 1
        if timeout is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(timeout)
        if self.message is None:
            raise Empty
        return self.message


@pytest.fixture
def missed(monkeypatch):
    fake = _MissedWakeups({"msg": "reply"})
    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", fake.get_msg)
    monkeypatch.setattr(nbexec, "SLICE_S", 0.05)
    return fake


def _get(timeout):
    channel = nbexec.SlicedChannel.__new__(nbexec.SlicedChannel)  # no socket: the fake stands in for it
    return asyncio.run(asyncio.wait_for(channel.get_msg(timeout), 5))


def test_a_missed_wakeup_costs_one_slice_not_for_ever(missed):
    t0 = time.monotonic()
    assert _get(None) == {"msg": "reply"}  # unsliced, this wait would never end (wait_for would raise at 5 s)
    assert time.monotonic() - t0 < 1 and missed.calls == 1


def test_the_callers_timeout_still_holds(missed):
    missed.message = None
    t0 = time.monotonic()
    with pytest.raises(Empty):
        _get(0.3)
    took = time.monotonic() - t0
    assert 0.28 <= took < 1.5 and missed.calls >= 5  # 0.3 s in slices of 0.05 s


def test_papermill_runs_get_the_sliced_client(monkeypatch):
    # nbclient makes its kernel client with km.client(): that must be the sliced one, with sliced channels
    client = nbexec.SlicedKernelManager().client()
    assert isinstance(client, nbexec.SlicedKernelClient)
    for name in ("shell", "iopub", "stdin", "control"):
        assert getattr(client, f"{name}_channel_class") is nbexec.SlicedChannel
    # and kvlab's papermill call hands nbclient that manager
    import papermill

    seen = {}
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **kw: seen.update(kw))
    nbexec.execute_notebook("in.ipynb", "out.ipynb", execution_timeout=5)
    assert seen["kernel_manager_class"] is nbexec.SlicedKernelManager and seen["execution_timeout"] == 5


def test_the_kernels_exit_message_is_dropped_and_everything_else_it_says_is_kept():
    """ipykernel's control task destroyed at exit (seen in a fresh-clone CI run) is not the notebook's business; any
    other line of the kernel process's stderr still reaches the user."""
    from kvlab.nbexec import kernel_stderr

    noise = ("Task was destroyed but it is pending!\n"
             "task: <Task pending name='Task-410' coro=<Kernel.dispatch_control() running at /x/ipykernel/"
             "kernelbase.py:372> wait_for=<Future pending cb=[Task.task_wakeup()]>>\n")
    assert kernel_stderr(noise) == ""
    assert kernel_stderr("real trouble\n" + noise + "more\n") == "real trouble\nmore\n"
    other = "Task was destroyed but it is pending!\ntask: <Task pending name='Task-3' coro=<mine() running>>\n"
    assert kernel_stderr(other) == other  # the same message about a task of the notebook's own stays


def test_the_shutdown_sigint_is_dropped_only_as_the_kernels_last_words():
    """jupyter_client interrupts a kernel as it shuts it down; caught in a handler, ipykernel logs it (seen in a
    fresh-clone CI run). As the log's end it is the shutdown's; anywhere else (a real Ctrl-C) it is kept."""
    from kvlab.nbexec import kernel_stderr

    line = "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel.\n"
    assert kernel_stderr(line) == ""
    assert kernel_stderr("real trouble\n" + line) == "real trouble\n"
    assert kernel_stderr(line + "after it\n") == line + "after it\n"
    noise = ("Task was destroyed but it is pending!\n"
             "task: <Task pending name='Task-9' coro=<Kernel.dispatch_control() running at /x.py:1>>\n")
    assert kernel_stderr(line + noise) == ""  # both exit messages, in the order a shutdown leaves them
