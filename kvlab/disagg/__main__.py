"""`python -m kvlab.disagg --rank R ...`: one worker process, as kvlab.disagg.launch starts it (not a user command:
users run `kvlab disagg`)."""

from __future__ import annotations

import json
import os
import sys
import traceback

from .workers import entry


def main(argv=None) -> int:
    """`python -m kvlab.disagg --rank R --config JSON --host H --port P --prefix X --run-dir D [--generation G]`: one worker,
    as the launcher starts it. A failure is posted to the control store and ends this process with code 1."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvlab.disagg")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--generation", type=int, default=0)
    a = p.parse_args(argv)
    try:
        entry(a.rank, json.loads(a.config), a.host, a.port, a.prefix, a.run_dir, progress=False,
              generation=a.generation)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    if code:
        # a failed worker leaves without the interpreter's teardown: a gloo or NIXL thread still blocked there makes
        # C++ call std::terminate (SIGABRT, "terminate called without an active exception"), and the launcher would
        # then see a crash where this process has posted its error
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
