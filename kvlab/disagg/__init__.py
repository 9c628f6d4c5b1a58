"""Prefill and decode as two processes: the cache crosses a process boundary.

    kvlab.disagg.DisaggConfig      what to run (backend, model, contexts, modes, layouts, devices, repeats)
    kvlab.disagg.run(cfg, out)     start both workers, wait, write requests.csv, summary.json, run.json
    kvlab.disagg.config            every check made before a process starts
    kvlab.disagg.backends          one record per backend: its traits, what it needs (unavailable), its link
    kvlab.disagg.protocol          request ids, landed layers, the refusal to decode a partial cache, deadlines
    kvlab.disagg.endpoints         both ends of the data path: Source, Sink, a paged cache's rows
    kvlab.disagg.links             the data path per backend: ipc (CUDA IPC), nccl, gloo (nixl_link: NIXL)
    kvlab.disagg.workers           one worker process: entry (kvlab.disagg.prefill, .decode: the two workers;
                                   .group: the control store, the process group, the host's clock)
    kvlab.disagg.summary           summary.json: medians and checks per config, the bench, the campaign

`kvlab disagg --help` shows the command; README's "Two processes" section the two-node form under torchrun.
"""

from .backends import BACKENDS, Backend, backend
from .config import LAYOUTS, MODES, DisaggConfig, check, from_params
from .launch import DisaggError, run
from .summary import summarise
from .protocol import IncompleteCacheError, LandedLayers

__all__ = ["DisaggConfig", "from_params", "run", "check", "backend", "Backend", "DisaggError", "IncompleteCacheError",
           "LandedLayers", "BACKENDS", "MODES", "LAYOUTS", "summarise"]
