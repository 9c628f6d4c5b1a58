"""papermill with a kernel client whose waits cannot miss a message.

nbclient waits for a cell's reply with ``await channel.get_msg(timeout)``, which polls a ZeroMQ socket through
asyncio. That poll can miss the wake-up of a message that has already arrived (pyzmq's edge-triggered socket
descriptor; zeromq/pyzmq#1558 shows the same: the event comes back only when the poll's timeout fires). With
papermill's default of no timeout, the run then waits for ever. Measured in data/probes/notebook_stalls (the
calculator notebook under pytest, both cores of a 2-core machine kept busy, a 60-s cell timeout): 5 of 20 plain
papermill runs stalled until the timeout, after the widget cell's last message had arrived; 0 of 20 with the
waits below (longest run 12.2 s). A CI run of this workbook, with no timeout, most likely died of it at its
90-minute limit (it stopped in that notebook's test, with no stack to show).

The fix is to wait in slices: each ``get_msg`` polls for at most ``SLICE_S`` seconds at a time. When a slice
ends, pyzmq checks the socket once more without waiting, so a missed wake-up costs at most one slice, and the
caller's own timeout is still honoured. Everything else is jupyter_client's.

The kernel's own stderr (the process's, not a cell's: cells' output reaches the notebook) goes to a temporary file,
which `execute_notebook` copies to this process's stderr once the notebook is done — less one message ipykernel
sometimes leaves as the kernel exits, asyncio's "Task was destroyed but it is pending!" for its control-channel
task (Kernel.dispatch_control), which says nothing about the notebook (seen in a fresh-clone CI run on 2026-12-04);
and, as the last thing the kernel says, "KeyboardInterrupt caught in kernel.": jupyter_client's shutdown sends the
kernel SIGINT before its shutdown request, and a kernel inside a message handler at that moment logs it (seen in a
fresh-clone CI run on 2026-12-04). The same line anywhere else in the log is kept.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from queue import Empty

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.manager import AsyncKernelManager
from traitlets import DottedObjectName, Type

__all__ = ["SLICE_S", "SlicedChannel", "SlicedKernelClient", "SlicedKernelManager", "execute_notebook", "kernel_stderr"]

SLICE_S = 1.0


class SlicedChannel(AsyncZMQSocketChannel):
    """A kernel channel whose ``get_msg`` polls at most SLICE_S seconds at a time until its timeout."""

    async def get_msg(self, timeout: float | None = None) -> dict:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await super().get_msg(timeout=min(SLICE_S, left))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class SlicedKernelClient(AsyncKernelClient):
    shell_channel_class = Type(SlicedChannel)  # type: ignore[assignment]
    iopub_channel_class = Type(SlicedChannel)  # type: ignore[assignment]
    stdin_channel_class = Type(SlicedChannel)  # type: ignore[assignment]
    control_channel_class = Type(SlicedChannel)  # type: ignore[assignment]


_KERNEL_LOGS: list = []  # the temporary files the kernels started here write their stderr to, not yet copied

# ipykernel's control-channel task, destroyed pending as the kernel process exits: asyncio's two lines about it
_EXIT_NOISE = re.compile(r"Task was destroyed but it is pending!\ntask: <Task pending name='Task-\d+' "
                         r"coro=<Kernel\.dispatch_control\(\)[^\n]*(?:\n|$)")
# the SIGINT jupyter_client sends a kernel as it shuts it down, caught in a message handler: only as the log's end
_SHUTDOWN_SIGINT = re.compile(r"(?:^|(?<=\n))\[IPKernelApp\] ERROR \| KeyboardInterrupt caught in kernel\.?\s*\Z")


class SlicedKernelManager(AsyncKernelManager):
    # AsyncKernelManager gives client_factory a default of its own, so both are set
    client_class = DottedObjectName("kvlab.nbexec.SlicedKernelClient")
    client_factory = Type(SlicedKernelClient, klass=AsyncKernelClient)

    async def start_kernel(self, **kw):  # type: ignore[override]
        """jupyter_client's, with the kernel process's stderr in a temporary file (module doc)."""
        if "stderr" not in kw:
            log = tempfile.TemporaryFile()
            _KERNEL_LOGS.append(log)
            kw["stderr"] = log
        return await super().start_kernel(**kw)


def kernel_stderr(text: str) -> str:
    """What of a kernel process's stderr is worth showing: all of it but ipykernel's exit messages (module doc)."""
    return _SHUTDOWN_SIGINT.sub("", _EXIT_NOISE.sub("", text))


def _copy_kernel_logs() -> None:
    while _KERNEL_LOGS:
        log = _KERNEL_LOGS.pop(0)
        try:
            log.seek(0)
            text = kernel_stderr(log.read().decode(errors="replace"))
        finally:
            log.close()
        if text.strip():
            sys.stderr.write(text if text.endswith("\n") else text + "\n")


def execute_notebook(*args, **kwargs):
    """``papermill.execute_notebook`` with the sliced kernel client (every argument is papermill's); the kernel's
    stderr is copied to this process's once the notebook is done (module doc)."""
    import papermill

    kwargs.setdefault("kernel_manager_class", SlicedKernelManager)
    try:
        return papermill.execute_notebook(*args, **kwargs)
    finally:
        _copy_kernel_logs()
