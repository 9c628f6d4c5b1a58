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
"""

from __future__ import annotations

import json
import pickle
from datetime import timedelta

__all__ = ["IncompleteCacheError", "LandedLayers", "Control"]


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
    """Control messages over a torch.distributed Store, each wait bounded by a deadline.

    store: a TCPStore (or PrefixStore) both processes reach; timeout_s: the default deadline of `wait`.
    """

    def __init__(self, store, timeout_s: float):
        self.store = store
        self.timeout_s = float(timeout_s)

    def post(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def post_bytes(self, key: str, obj) -> None:
        self.store.set(key, pickle.dumps(obj))

    def ready(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _wait(self, key: str, what: str, timeout_s: float | None):
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            self.store.wait([key], timedelta(seconds=t))
        except Exception as err:  # torch raises DistStoreError (a RuntimeError) on timeout and on a lost peer
            raise TimeoutError(f"waited {t:g} s for {what} ({key!r}) and it did not come: the peer process is "
                               f"dead, stuck or too slow ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
        return self.store.get(key)

    def wait(self, key: str, what: str, timeout_s: float | None = None):
        return json.loads(self._wait(key, what, timeout_s))

    def wait_bytes(self, key: str, what: str, timeout_s: float | None = None):
        return pickle.loads(self._wait(key, what, timeout_s))
