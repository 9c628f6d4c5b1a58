"""A CUDA IPC handle as plain fields: what the decode side posts so the prefill side can map its destination.

torch's own way to share a CUDA tensor is a pickle (`reduce_tensor` returns a function and its arguments), and
loading a pickle runs whatever it names. Here the sender posts only data — integers, a dtype's name and the handles'
bytes (base64) — and the receiver checks every field and rebuilds the tensor with one fixed function, torch's
`rebuild_cuda_tensor`, on torch.Tensor and a storage class it picks itself. The handles themselves are torch's
(`UntypedStorage._share_cuda_`), so reference counting between the two processes is the one torch does.

    fields = export(tensor)     decode side: a dict JSON can carry
    tensor = rebuild(fields)    prefill side: checked (`check`), then mapped
"""

from __future__ import annotations

import base64
import binascii

import torch

__all__ = ["export", "check", "rebuild", "DTYPES"]

# the dtypes a destination can have (a cache's K and V, FP8 on the wire, raw bytes)
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16, torch.float32,
                                                     torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8,
                                                     torch.int8, torch.int32, torch.int64)}
_STORAGES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
_INTS = ("offset", "device", "size_bytes", "offset_bytes", "ref_offset")
_BYTES = ("handle", "ref_handle", "event")
_FIELDS = {"size", "stride", "storage", "dtype", "event_sync", *_INTS, *_BYTES}
_MAX_DIMS = 8
_MAX_HANDLE = 1024  # bytes: a cudaIpcMemHandle is 64, the ref counter's shared-memory name a few dozen


def export(tensor: torch.Tensor) -> dict:
    """The fields that let another process map `tensor` (a CUDA tensor that needs no grad)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"CUDA IPC shares CUDA memory; this tensor is on {tensor.device}")
    if tensor.requires_grad or type(tensor) is not torch.Tensor:
        raise ValueError("CUDA IPC here shares plain tensors that need no grad (a destination buffer)")
    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes, _,
     ref_handle, ref_offset, event, event_sync) = args
    return {"size": list(size), "stride": list(stride), "offset": int(offset), "storage": storage_cls.__name__,
            "dtype": str(dtype).removeprefix("torch."), "device": int(device), "handle": _b64(handle),
            "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes), "ref_handle": _b64(ref_handle),
            "ref_offset": int(ref_offset), "event": _b64(event), "event_sync": bool(event_sync)}


def _b64(b) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode()


def _unb64(field: str, v) -> bytes | None:
    if v is None and field == "event":
        return None
    if not isinstance(v, str) or len(v) > 2 * _MAX_HANDLE:
        raise ValueError(f"CUDA IPC field {field}: expected base64 text of at most {_MAX_HANDLE} bytes, got {v!r:.60}")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"CUDA IPC field {field}: {v!r:.60} is not base64") from None


def _int(field: str, v, low: int = 0) -> int:
    if type(v) is not int or v < low:
        raise ValueError(f"CUDA IPC field {field}: expected an integer ≥ {low}, got {v!r:.60}")
    return v


def check(fields) -> tuple:
    """The arguments of torch's rebuild_cuda_tensor from `fields`, every one checked: ValueError in one line naming
    the field otherwise. The classes are chosen here (torch.Tensor; a storage class from a fixed pair), never read."""
    if not isinstance(fields, dict):
        raise ValueError(f"CUDA IPC handle: expected an object of fields, got {type(fields).__name__}")
    if set(fields) != _FIELDS:
        odd = sorted(set(fields) ^ _FIELDS)
        raise ValueError(f"CUDA IPC handle: fields {odd} are missing or not expected (valid: {sorted(_FIELDS)})")
    dims = []
    for name in ("size", "stride"):
        v = fields[name]
        if not isinstance(v, list) or len(v) > _MAX_DIMS:
            raise ValueError(f"CUDA IPC field {name}: expected a list of at most {_MAX_DIMS} integers, got {v!r:.60}")
        dims.append(tuple(_int(name, x) for x in v))
    if len(dims[0]) != len(dims[1]):
        raise ValueError(f"CUDA IPC fields size and stride: {len(dims[0])} and {len(dims[1])} dimensions")
    if not isinstance(fields["storage"], str) or fields["storage"] not in _STORAGES:
        raise ValueError(f"CUDA IPC field storage: {fields['storage']!r:.60} (valid: {sorted(_STORAGES)})")
    if not isinstance(fields["dtype"], str) or fields["dtype"] not in DTYPES:
        raise ValueError(f"CUDA IPC field dtype: {fields['dtype']!r:.60} (valid: {sorted(DTYPES)})")
    if type(fields["event_sync"]) is not bool:
        raise ValueError(f"CUDA IPC field event_sync: expected true or false, got {fields['event_sync']!r:.60}")
    n = {k: _int(k, fields[k]) for k in _INTS}
    b = {k: _unb64(k, fields[k]) for k in _BYTES}
    return (torch.Tensor, dims[0], dims[1], n["offset"], _STORAGES[fields["storage"]], DTYPES[fields["dtype"]],
            n["device"], b["handle"], n["size_bytes"], n["offset_bytes"], False, b["ref_handle"], n["ref_offset"],
            b["event"], fields["event_sync"])


def rebuild(fields) -> torch.Tensor:
    """The decode side's tensor, mapped into this process from `fields` (see `export`)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*check(fields))
