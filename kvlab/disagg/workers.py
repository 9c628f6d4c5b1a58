"""The two processes: a prefill worker and a decode worker, each owning its device and its own copy of the
model (built from the same config with the same seed, so the weights are identical bit for bit).

The decode worker drives: for each layout and context it computes its colocated reference (prefill and
decode on its own device), allocates its destination (a contiguous buffer, or a pool with its own block
table), poisons it before every request, and posts ``req{r}/go``. The prefill worker prefills, sends in bulk
after prefill or layer by layer from the per-layer signal, and posts ``req{r}/done``. The decode worker waits
until every layer has landed (each wait bounded by the deadline), refuses to decode otherwise
(protocol.IncompleteCacheError), decodes, and compares tokens, logits and bytes with its reference.

Clocks: both processes read CLOCK_MONOTONIC (time.monotonic_ns), which one host shares, so "exposed" (last
layer known landed on the decode side − prefill end on the prefill side) and the decode side's TTFT are
differences of one clock. Across two nodes the clocks differ: `same_host` in the rows says which case a row is
(the host name and the kernel's boot id agree: one clock).

    entry(rank, ...)   one process of the pair: its device, group, model and link, then its worker
    prefill.py         PrefillWorker          decode.py   DecodeWorker
    group.py           connect, init_group, host_id, now_ns: what both processes share
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .backends import BACKENDS
from .config import DECODE, PREFILL, DisaggConfig
from .decode import DecodeWorker
from .group import build_model, connect, init_group
from .prefill import PrefillWorker
from .protocol import KEY_ENV, Control, run_key

__all__ = ["entry", "connect", "init_group", "ROWS_FILE"]

ROWS_FILE = "decode_rows.json"  # what the decode worker hands to the launcher (removed once tables are written)


def entry(rank: int, cfg_dict: dict, host: str, port: int, prefix: str, run_dir: str, progress: bool = True,
          generation: int = 0, key: bytes | None = None) -> None:
    """One process of the pair (the launcher's subprocess, or torchrun's process through the CLI).
    Errors are posted as ``error/<role>`` (one line) before they propagate, so the launcher can name them.
    generation > 0: a prefill process started in place of a dead one. key: the run key that signs the control
    messages (None: read from KVLAB_CONTROL_KEY, kvlab.disagg.protocol.run_key)."""
    cfg = DisaggConfig(**cfg_dict)
    role = "decode" if rank == DECODE else "prefill"
    key = run_key(where="a kvlab disagg worker") if key is None else key
    os.environ.pop(KEY_ENV, None)  # read once: nothing this process starts (compilers, UCX) inherits the secret
    store = connect(host, port, prefix, cfg.timeout_s)
    control = Control(store, cfg.timeout_s, key, scope=prefix)
    try:
        if cfg.threads or not torch.cuda.is_available():
            torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) // 2))
        pre, dec = cfg.devices()
        dev = torch.device(dec if rank == DECODE else pre)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if generation:  # a successor builds its model first, so it is ready when the decode side joins it
            model = build_model(cfg, dev)
        init_group(cfg, dev, store, rank, generation)
        if BACKENDS[cfg.backend].group == "nccl":
            # NCCL's first point-to-point call blocks until the peer makes one too; the decode side posts its
            # receives before it sends a request, so without this exchange both sides would wait for each other
            one = torch.zeros(1, device=dev)
            for step in ((DECODE, PREFILL), (PREFILL, DECODE)):
                if rank == step[0]:
                    dist.send(one, dst=step[1])
                else:
                    dist.recv(one, src=step[0])
            torch.cuda.synchronize(dev)
        if not generation:
            model = build_model(cfg, dev)
        link = BACKENDS[cfg.backend].make_link(role, dev, control, cfg.timeout_s,
                                               peer=PREFILL if rank == DECODE else DECODE,
                                               nixl_descs=cfg.nixl_descs, in_order=cfg.in_order)
        w = None
        ok = False
        try:
            if rank == DECODE:
                w = DecodeWorker(cfg, model, dev, control, link, progress)
                w.run()
                out = {"rows": w.rows, "bench": w.bench_rows, "tuned": w.tuned, "faults": w.fault_rows,
                       "in_order": getattr(w.link, "in_order", False),
                       "memory": w.mem.rows, "pid": os.getpid(),
                       "peer_pid": control.wait("pid/prefill", "the prefill process's pid"),
                       "host": socket.gethostname()}
                control.wait("released", "the prefill process to let go of this process's memory")
                Path(run_dir, ROWS_FILE).write_text(json.dumps(out))
            else:
                start = control.wait(f"gen{generation}/from", "the request to answer first") if generation else 0
                control.post("pid/prefill", os.getpid())
                PrefillWorker(cfg, model, dev, control, link, generation).serve(start)
            ok = True
        finally:
            try:
                (w.link if w is not None else link).close()
            except Exception:
                if ok:
                    raise
                # an error is already on its way out: it, not a close that failed after it, is what gets posted
        dist.destroy_process_group()
    except BaseException as err:
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        try:
            control.post(f"error/{role}", {"error": line, "traceback": traceback.format_exc()[-4000:],
                                           "memory": getattr(err, "memory_rows", None)})
        except Exception:
            pass
        raise
