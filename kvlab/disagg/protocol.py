"""The completion protocol between the prefill and the decode process.

Two things cross the process boundary besides the cache itself:

* control messages — a key-value store (torch.distributed.TCPStore, the same store torchrun's env://
  rendezvous uses): the decode side posts ``req{r}/go`` (what to prefill and where its blocks are), the
  prefill side posts ``req{r}/done`` (its first token and its clock readings) and, for CUDA IPC, one
  ``req{r}/landed/u{k}`` key per unit sent (all layers in bulk, one layer layer-wise), holding the unit's layers,
  once its copy has completed on the GPU. Every wait has a
  deadline: a dead or silent peer is a TimeoutError naming what was awaited, never a hang.
* landing — what the decode side *knows* has arrived. `LandedLayers` records it per request, refuses a
  layer signalled twice, a negative or out-of-range layer, or a signal for a request that is not the
  current one; `require(r)` raises IncompleteCacheError naming the request and the missing layers, and
  the decode worker calls it before every decode.

The store has no authentication, and a TCPStore a client can reach is open to every process that can reach its port.
So every value kvlab posts carries an HMAC-SHA256 under a per-run key (`run_key`) that only this run's processes
hold: the launcher draws it and hands it to its workers in their environment (KVLAB_CONTROL_KEY), and under torchrun
the user sets the same key on every node. The MAC covers the store's prefix, the key and the value, so a value
copied from another key or another run does not verify either. A value that does not verify is refused before it is
parsed (ControlIntegrityError, naming the key) and the run stops; nothing read from the store is ever unpickled or
run. What a stranger can still do is break a run: delete a key (the wait for it times out, naming it) or write
garbage (refused). kvlab uses no unsigned counter (`store.add`): text a stranger writes into one makes the store
close the connection of the next client that adds to it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from datetime import timedelta

__all__ = ["IncompleteCacheError", "ControlIntegrityError", "LandedLayers", "Control", "KEY_ENV", "new_key",
           "run_key", "unverified"]

KEY_ENV = "KVLAB_CONTROL_KEY"  # the run's HMAC key, as hex, in each worker's environment
_MIN_KEY_BYTES = 16
_TAG = b"kvlab-hmac1:"  # what a signed value starts with: the scheme, then the MAC in hex, ':', the JSON body


def _split(raw) -> tuple[bytes, bytes] | None:
    """(MAC, body) of a value in the signed form (`Control.seal`), or None when it is not in that form."""
    raw = raw.encode() if isinstance(raw, str) else bytes(raw)
    if raw.startswith(_TAG) and len(raw) > len(_TAG) + 65 and raw[len(_TAG) + 64:len(_TAG) + 65] == b":":
        return raw[len(_TAG):len(_TAG) + 64], raw[len(_TAG) + 65:]
    return None


def unverified(raw):
    """The value a signed store value holds, its MAC NOT checked: for an onlooker without the run key (a test or a
    probe watching a run's progress), never for a decision. None when `raw` is not in the signed form."""
    parts = _split(raw)
    return None if parts is None else json.loads(parts[1])


class ControlIntegrityError(RuntimeError):
    """A value in the control store that this run's processes did not write (or that was changed on the way)."""


def new_key() -> str:
    """A fresh run key: 32 random bytes, as 64 hex digits."""
    return secrets.token_hex(32)


def run_key(environ=None, where: str = "") -> bytes:
    """The run key from KVLAB_CONTROL_KEY (hex, at least 16 bytes). ValueError in one line when it is missing or
    malformed; `where` says who needs it (e.g. "under torchrun every process")."""
    env = os.environ if environ is None else environ
    text = env.get(KEY_ENV, "")
    how = (f"set {KEY_ENV} to the same secret on every node, e.g. "
           f"export {KEY_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))')")
    if not text:
        raise ValueError(f"{KEY_ENV} is not set{': ' + where + ' needs it' if where else ''}; {how}")
    text = text.strip()
    bad = next((i for i, ch in enumerate(text) if ch not in "0123456789abcdefABCDEF"), None)
    if bad is not None or len(text) % 2:  # the secret itself is never echoed: its length and where it goes wrong
        why = f"character {bad + 1} is not a hex digit" if bad is not None else "an odd number of hex digits"
        raise ValueError(f"{KEY_ENV} ({len(text)} characters) is not hexadecimal ({why}); {how}")
    key = bytes.fromhex(text)
    if len(key) < _MIN_KEY_BYTES:
        raise ValueError(f"{KEY_ENV} holds {len(key)} bytes: at least {_MIN_KEY_BYTES} (32 hex digits) are needed; {how}")
    return key


class IncompleteCacheError(RuntimeError):
    """Decode was asked to run on a cache whose send has not landed completely."""


class LandedLayers:
    """Which layers of the current request are visible on the decode device.

    layers: layers per request; device: named in errors. A new request (`begin`) forgets the old one:
    the destination is shared by successive requests, so the old request's layers are not this one's.
    """

    def __init__(self, layers: int, device: str = "the decode device"):
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers={layers!r}: expected a positive int")
        self.layers = layers
        self.device = device
        self.request: int | None = None
        self._landed: set[int] = set()

    def begin(self, request: int) -> None:
        self.request = int(request)
        self._landed = set()

    def mark(self, request: int, layer: int) -> None:
        if request != self.request:
            raise ValueError(f"layer {layer} signalled for request {request}, but the destination now belongs to "
                             f"request {self.request}")
        if not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ValueError(f"request {request}: layer {layer!r} is out of range (valid 0 … {self.layers - 1})")
        if layer in self._landed:
            raise ValueError(f"request {request}: layer {layer} signalled twice")
        self._landed.add(layer)

    def mark_all(self, request: int) -> None:
        for i in range(self.layers):
            self.mark(request, i)

    def missing(self, request: int) -> list[int]:
        if request != self.request:
            return list(range(self.layers))
        return [i for i in range(self.layers) if i not in self._landed]

    def complete(self, request: int) -> bool:
        return not self.missing(request)

    def require(self, request: int) -> None:
        """Raise IncompleteCacheError unless every layer of `request` has landed."""
        missing = self.missing(request)
        if missing:
            shown = missing if len(missing) <= 12 else missing[:12] + ["…"]
            raise IncompleteCacheError(
                f"request {request}: {len(missing)} of {self.layers} layers have not landed on {self.device} "
                f"(missing {shown}); decode refused")


class Control:
    """Control messages over a torch.distributed Store, each signed and each wait bounded by a deadline.

    store: a TCPStore (or PrefixStore) both processes reach; timeout_s: the default deadline of `wait`; key: the run
    key (`run_key`); scope: the store prefix the values live under (kept in the MAC, so a value is good only where
    it was written).
    """

    def __init__(self, store, timeout_s: float, key: bytes, scope: str = "kvlab"):
        if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
            raise ValueError(f"key: expected at least {_MIN_KEY_BYTES} bytes (kvlab.disagg.protocol.run_key)")
        self.store = store
        self.timeout_s = float(timeout_s)
        self._key = key
        self.scope = str(scope)

    def _mac(self, key: str, body: bytes) -> bytes:
        msg = self.scope.encode() + b"\0" + key.encode() + b"\0" + body
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, value) -> bytes:
        """What `post` stores for `value` under `key`: the scheme tag, the MAC and the JSON body."""
        body = json.dumps(value).encode()
        return _TAG + self._mac(key, body) + b":" + body

    def open(self, key: str, raw) -> object:
        """The value `raw` (as read from the store under `key`) holds, once its MAC has been checked; anything else
        is a ControlIntegrityError naming the key. The body is parsed only after it verified."""
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        parts = _split(raw)
        if parts is not None:
            mac, body = parts
            if hmac.compare_digest(mac, self._mac(key, body)):
                return json.loads(body)
            why = "its signature does not match (written by someone without this run's key, or changed since)"
        else:
            why = "it is not signed"
        raise ControlIntegrityError(f"control key {self.scope}/{key}: {why}; the value ({len(raw)} bytes) is refused "
                                    "unread and the run stops")

    def post(self, key: str, value) -> None:
        self.store.set(key, self.seal(key, value))

    def ready(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def read(self, key: str):
        """The checked value under `key`, or None when the key is absent (does not wait)."""
        return self.open(key, self.store.get(key)) if self.ready(key) else None

    def wait(self, key: str, what: str, timeout_s: float | None = None):
        """The checked value under `key`, once it is there; TimeoutError naming `what` and the key after the
        deadline (timeout_s, else the default)."""
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            self.store.wait([key], timedelta(seconds=t))
        except Exception as err:  # torch raises DistStoreError (a RuntimeError) on timeout and on a lost peer
            raise TimeoutError(f"waited {t:g} s for {what} ({key!r}) and it did not come: the peer process is "
                               f"dead, stuck or too slow ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
        return self.open(key, self.store.get(key))
