"""A run folder's life outside its record: may a folder take a new run (check_run_folder), what state a folder is
in (run_state), setting a stopped attempt aside, marking how a notebook's execution ended (record_execution and the
STOPPED.txt it writes), and the signals that stop a run (SIGTERM as an exception, a block deaf to a second signal).

kvlab.results writes and reads the record itself (run.json and its tables); this module never opens a table."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
from pathlib import Path

from . import claims, paths

RUN_JSON = "run.json"
STOPPED = "STOPPED.txt"  # written into a run folder whose notebook failed or was interrupted

__all__ = ["RUN_JSON", "STOPPED", "check_run_folder", "run_state", "set_aside_stopped", "record_execution",
           "stopped_text", "Terminated", "raise_on_sigterm", "shielded", "stop_reason"]


def check_run_folder(folder: str | os.PathLike, flag: str = "--run-dir") -> None:
    """ValueError when `folder` (given as option `flag`) may not receive a new run: an empty path, a file, a
    folder holding a finished run, or a folder with other files and no run.json (unless a claim whose process is gone says a run died there
    before writing it). A folder of a run that stopped (STOPPED.txt, or run.json not "finished") may be written
    again."""
    if str(folder).strip() == "":
        raise ValueError(f"{flag} is empty; give a folder (or leave the option out for a new one under data/)")
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(folder)!r} is a file, not a folder")
    record = folder / RUN_JSON
    c = claims.held(folder) if folder.is_dir() else None
    if record.is_file():
        try:
            earlier = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            earlier = None
        if not isinstance(earlier, dict):  # truncated (a full disk), or JSON that is not a record: never taken over
            raise ValueError(f"{flag} {str(folder)!r} holds a run.json that cannot be read as a run's record; kvlab "
                             "does not take such a folder over: give another folder (or move that one away first)")
        status = earlier.get("status")
        if status == "finished":
            raise ValueError(f"{flag} {str(folder)!r} holds a finished run; give a new folder (or delete that one "
                             "first) — kvlab does not overwrite a result")
        if status == "running" and c is None and (pid := _live_writer(earlier)) is not None:
            raise ValueError(f"{flag} {str(folder)!r} holds a run still in progress (process {pid} on this host); "
                             "give another folder — two runs in one folder overwrite each other's tables")
    elif (folder.is_dir() and any(p.name != claims.CLAIM for p in folder.iterdir())
          and not (folder / STOPPED).is_file() and not (c is not None and not claims.alive(c))):
        # (a claim whose process is gone and no run.json: a run that died before its record, e.g. on a full disk;
        # its files are set aside like any killed attempt's)
        raise ValueError(f"{flag} {str(folder)!r} is a folder with other files in it and no run.json; give a new "
                         "or empty folder")
    if c is not None and claims.alive(c) and not claims.owns(folder) and not claims.held_by_me(folder):
        who = "a claim file kvlab cannot read" if c.get("unreadable") else f"process {c.get('pid')} on {c.get('host')}"
        raise ValueError(f"{flag} {str(folder)!r} is being written by another run ({who}); give another folder — two "
                         "runs in one folder would overwrite each other's tables")


def run_state(folder: str | os.PathLike) -> str:
    """What a run folder is: "finished", "failed", "running" (its process is alive), "killed" (run.json says running
    and the process that claimed the folder, or started the run, is gone: a SIGKILL, a reboot), "stopped" (a
    STOPPED.txt and no run.json; without either, a claim whose process is gone is "killed" too, as a full disk
    leaves a run that could not write its record), "unreadable" (a run.json that is not a run's record) or "none" (no run)."""
    folder = Path(folder)
    meta = folder / RUN_JSON
    if not meta.is_file():
        if (folder / STOPPED).is_file():
            return "stopped"
        c = claims.held(folder)  # claimed, and nothing written yet: a run starting, or one that died starting
        return "none" if c is None else "running" if claims.alive(c) else "killed"
    try:
        record = paths.read_json(meta)
    except (OSError, UnicodeDecodeError, ValueError):
        return "unreadable"
    if not isinstance(record, dict):
        return "unreadable"
    status = record.get("status")
    if status != "running":
        return status if status in ("finished", "failed") else "unreadable"
    c = claims.held(folder)
    if c is not None:
        return "running" if claims.alive(c) else "killed"
    return "running" if _live_writer(record) is not None or record.get("pid") == os.getpid() else "killed"


def _live_writer(record: dict) -> int | None:
    """The pid of the process on this host that started the run whose run.json is `record`, if it is still alive;
    None otherwise (another host, no pid recorded, or the process is gone: a run killed without a word)."""
    import socket

    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return None
    if (record.get("host") or {}).get("hostname") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return pid
    return pid


def set_aside_stopped(folder: str | os.PathLike) -> Path | None:
    """A folder whose earlier run stopped (STOPPED.txt, or a claim whose process is gone: a run killed without a
    word) is about to hold a new run: the earlier attempt's files move into `stopped-<UTC time>/` inside it, so the
    new run's tables never mix with a partial run's and nothing is deleted; a killed attempt's files get a
    STOPPED.txt there saying so. The stale claim moves first, by one atomic rename, so of two runs taking the folder
    over at once only one sets it aside. Returns that subfolder (None when there was nothing to set aside)."""
    folder = Path(folder)
    c = claims.held(folder)
    killed = c is not None and not claims.alive(c)
    if not killed and not (folder / STOPPED).is_file():
        return None
    aside = folder / f"stopped-{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(exist_ok=True)
    if killed:
        try:
            (folder / claims.CLAIM).rename(aside / claims.CLAIM)
        except FileNotFoundError:  # another run took the folder over first
            aside.rmdir() if not any(aside.iterdir()) else None
            return None
    for p in list(folder.iterdir()):  # the live claim, if any, is the new run's: it stays
        if p != aside and not p.name.startswith("stopped-") and p.name != claims.CLAIM:
            p.rename(aside / p.name)
    if killed and not (aside / STOPPED).is_file():
        (aside / STOPPED).write_text(stopped_text(aside, "the run", f"its process {c.get('pid')} was gone: killed"),
                                     encoding="utf-8")
    return aside


def record_execution(run_dir: str | os.PathLike, notebook: str, ok: bool, seconds: float,
                     error: str | None = None) -> bool:
    """Note in a run's run.json how its notebook execution ended (``kvlab run`` calls this).

    A failed execution turns a still-"running" run into "failed", so ``latest()`` skips it, and writes
    ``STOPPED.txt`` into the folder (also when the notebook failed before ``start()``). Returns False when
    the run has no run.json.
    """
    # a failure is marked deaf to a second SIGTERM (`timeout` signals twice) or Ctrl-C
    with shielded() if not ok else contextlib.nullcontext():
        path = Path(run_dir) / RUN_JSON
        if ok:
            (Path(run_dir) / STOPPED).unlink(missing_ok=True)  # an earlier attempt into the same folder failed
        elif Path(run_dir).is_dir():
            # whoever lists the folder sees at once that it is not a result, run.json or not
            (Path(run_dir) / STOPPED).write_text(stopped_text(run_dir, notebook, error), encoding="utf-8")
        if not path.is_file():
            return False
        record = paths.read_json(path)
        record["execution"] = {"notebook": notebook, "ok": bool(ok), "seconds": round(seconds, 3),
                               "error": error}
        if not ok:  # also after finish(): a cell after it failed, so the notebook did not run to its end
            record["status"] = "failed"
        paths.write_json(path, record)
        return True


def stopped_text(run_dir: str | os.PathLike, notebook: str, error: str | None) -> str:
    """What STOPPED.txt says: why the run stopped, which folder, what is in it (run.json or not), and where to look."""
    folder = Path(run_dir)
    have = sorted(p.name for p in folder.iterdir() if p.name != STOPPED) if folder.is_dir() else []
    state = ("run.json says status: failed, and kvlab's readers skip the folder" if (folder / RUN_JSON).is_file() else
             "it stopped before run.json was written (the notebook failed before results.start)")
    return (f"This run stopped before it finished ({error or 'failed'}).\n"
            f"Folder: {folder.resolve()}\n"
            f"What is here: {', '.join(have) or 'nothing else'}; any tables and figures are partial; {state}.\n"
            + (f"The executed notebook, {notebook}, shows where it stopped.\n" if notebook.endswith(".ipynb") else
               f"{notebook} printed where it stopped; its workers' logs, if any, are in this folder.\n"))


class Terminated(KeyboardInterrupt):
    """SIGTERM (a `timeout`, a batch system) as an exception: handled like Ctrl-C, so a run folder says it stopped."""


def raise_on_sigterm():
    """Turn SIGTERM into Terminated until the returned `restore()` is called (main thread only; elsewhere, and where
    kvlab's handler is in place already, nothing changes and `restore()` does nothing).

    The handler raises once and ignores any later SIGTERM: GNU `timeout` signals the command and then its process
    group, and a second exception raised while the first is being handled would cut the marking short. A nested
    caller (kvlab disagg inside `kvlab`'s main) leaves the outer handler alone, so it cannot re-arm one that has
    fired. A process started after the handler fired gets the default action (exec resets caught signals)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = signal.getsignal(signal.SIGTERM)
    if getattr(old, "_kvlab_sigterm", False):
        return lambda: None

    def handler(signum, frame):
        if handler.fired:
            return
        handler.fired = True
        raise Terminated("terminated (SIGTERM)")

    handler._kvlab_sigterm = True
    handler.fired = False
    signal.signal(signal.SIGTERM, handler)

    def restore():
        # None: a handler set outside Python, which Python cannot put back; the default is the nearest
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)

    return restore


@contextlib.contextmanager
def shielded():
    """Ignore SIGTERM and Ctrl-C for the block (main thread only): a run folder being marked stopped must not be cut
    short by the second signal `timeout` sends, or by a second Ctrl-C. What was set before is put back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in held.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def stop_reason(err: BaseException) -> str:
    """What a run folder says about why it stopped: 'terminated (SIGTERM)', 'interrupted (Ctrl-C)' or the error."""
    if isinstance(err, Terminated):
        return str(err)
    return "interrupted (Ctrl-C)" if isinstance(err, KeyboardInterrupt) else str(err)
