"""One run to a folder: a run folder is claimed atomically before anything is written into it.

`claim(folder)` creates ``<folder>/.kvlab-claim.json`` with O_CREAT | O_EXCL, holding the claiming process's pid,
host, boot id, a random token and the time: of two runs started into one folder at once, exactly one gets it and
the other is refused in one line. A claim whose process is gone (a run killed with SIGKILL, a machine that
rebooted) is stale: the folder is recognisable as a run that stopped, and the next claim moves that attempt's files
into ``stopped-<UTC>/`` inside it (nothing mixes, nothing is deleted) before claiming. A process that starts a run
in another process (`kvlab run` starts a kernel; the disagg launcher its workers) hands its claim on through the
environment (``KVLAB_CLAIM``: the token), and the run it started owns the folder as its own.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import socket
from pathlib import Path

__all__ = ["CLAIM", "ENV", "claim", "held", "held_by_me", "owns", "alive", "boot_id"]

CLAIM = ".kvlab-claim.json"
ENV = "KVLAB_CLAIM"


def boot_id() -> str:
    """This machine's boot id (Linux), so a pid from before a reboot is not taken for a live process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def held(folder: str | os.PathLike) -> dict | None:
    """The claim on `folder` ({pid, host, boot, token, utc}), None when there is none; an unreadable claim file is
    a claim whose owner cannot be told ({"unreadable": True})."""
    path = Path(folder) / CLAIM
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return {"unreadable": True}
    try:
        out = json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable": True}
    return out if isinstance(out, dict) else {"unreadable": True}


def alive(claim: dict) -> bool:
    """Is the process that made `claim` still running (on this host, since this boot)? A claim of another host
    counts as alive: kvlab cannot tell from here, so it does not take the folder over."""
    if claim.get("unreadable"):
        return True
    if claim.get("host") != socket.gethostname():
        return True
    if claim.get("boot") and claim.get("boot") != boot_id():
        return False
    pid = claim.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _ours(claim: dict) -> bool:
    return (claim.get("pid") == os.getpid() and claim.get("host") == socket.gethostname()
            and claim.get("boot", "") == boot_id())


def held_by_me(folder: str | os.PathLike) -> bool:
    """Did this very process claim `folder` (a notebook cell run again in the same kernel)?"""
    c = held(folder)
    return c is not None and not c.get("unreadable") and _ours(c)


def owns(folder: str | os.PathLike, token: str | None = None) -> bool:
    """Does this process hold `folder`'s claim (its token is `token`, default the one handed on in KVLAB_CLAIM)?"""
    token = token if token is not None else os.environ.get(ENV, "")
    c = held(folder)
    return bool(token) and c is not None and c.get("token") == token


def _create(folder: Path) -> str:
    token = secrets.token_hex(16)
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "boot": boot_id(), "token": token,
                       "utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    fd = os.open(folder / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # FileExistsError: someone was first
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(body + "\n")
    return token


def claim(folder: str | os.PathLike, flag: str = "--run-dir", set_aside=None) -> str:
    """Claim `folder` (created if missing) for one run; returns the claim's token. ValueError (one line, naming the
    folder and `flag`) when a live process holds it. A stale claim (its process gone): `set_aside(folder)` first
    moves the stopped attempt's files aside (kvlab.runfolder.set_aside_stopped), then the folder is claimed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        try:
            return _create(folder)
        except FileExistsError:
            pass
        c = held(folder)
        if c is None:  # released between our try and our look: try again
            continue
        if _ours(c):  # this very process claimed it before (a notebook cell run again): the folder is still ours
            token = secrets.token_hex(16)
            tmp = folder / f".{CLAIM}.{os.getpid()}"
            tmp.write_text(json.dumps(dict(c, token=token)) + "\n", encoding="utf-8")
            os.replace(tmp, folder / CLAIM)
            return token
        if alive(c):
            who = ("a claim file kvlab cannot read" if c.get("unreadable") else
                   f"process {c.get('pid')} on {c.get('host')} since {c.get('utc')}")
            raise ValueError(f"{flag} {str(folder)!r} is being written by another run ({who}); give another folder "
                             "— two runs in one folder would overwrite each other's tables")
        # a killed run's claim: its attempt is set aside with its files (the rename is atomic: of two runs taking
        # the folder over at once, one moves the claim and the other finds the new claim alive)
        if set_aside is not None:
            set_aside(folder)
        else:
            try:
                (folder / CLAIM).unlink()
            except FileNotFoundError:
                pass
    raise ValueError(f"{flag} {str(folder)!r}: its claim changed hands three times while this run tried to take it; "
                     "give another folder")
