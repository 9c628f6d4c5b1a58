"""What hardware and software is here: GPUs, peer access, driver, CUDA, host, package versions.

Everything here answers on a CPU-only machine too (no GPU, no driver, no nvidia-smi): a missing
piece is reported as ``None`` or an empty list, never as an exception. ``describe()`` is the record
that ``kvlab.results`` writes into every run.json and that ``kvlab info`` prints.

torch is imported inside the functions that need it, so ``import kvlab.devices`` is cheap.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
from importlib import metadata

# the hardware presets a notebook resolves "auto" to (KVLAB_PRESET forces one)
PRESETS = ("gpu", "cpu")

# Distribution names to ask importlib.metadata about, per reported package. Several packages ship
# under more than one name (CUDA-suffixed builds, nightlies); the first one installed wins.
_PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "triton": ("triton", "pytorch-triton"),
    "nixl": ("nixl", "nixl-cu12", "nixl-cu13"),
    "numpy": ("numpy",),
    "pandas": ("pandas",),
    "papermill": ("papermill",),
    "cuda-bindings": ("cuda-bindings", "cuda-python"),
    "kvlab": ("kvlab",),
}

# Words in a GPU's marketing name that say who made it or which line it belongs to, not which chip
# it is; dropped before picking the model token for a device tag.
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct", "graphics"}


def _torch():
    """torch, or None when it is not installed (the calls below then report no GPU)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def has_cuda() -> bool:
    """True when torch is installed and sees at least one CUDA (or ROCm) device."""
    torch = _torch()
    return bool(torch is not None and torch.cuda.is_available())



def preset() -> str:
    """``"gpu"`` when a CUDA device is here, else ``"cpu"``; ``KVLAB_PRESET`` overrides.

    Raises ValueError for a ``KVLAB_PRESET`` other than gpu/cpu/auto, and RuntimeError when it
    asks for gpu on a machine without one (a silent CPU run would be mistaken for a GPU result).
    """
    forced = os.environ.get("KVLAB_PRESET", "").strip().lower()
    if forced not in ("", "auto", *PRESETS):
        raise ValueError(f"KVLAB_PRESET={forced!r} is not valid; use one of: gpu, cpu, auto")
    if forced == "gpu":
        if not has_cuda():
            raise RuntimeError("KVLAB_PRESET=gpu, but torch sees no CUDA device on this machine")
        return "gpu"
    if forced == "cpu":
        return "cpu"
    return "gpu" if has_cuda() else "cpu"


def gpus() -> list[dict]:
    """One dict per visible GPU, in torch's device order (CUDA_VISIBLE_DEVICES applies).

    Keys: ``index`` (int), ``name`` (str, as the driver reports it), ``memory_bytes`` (int, total
    device memory in bytes), ``compute_capability`` (str, "major.minor", e.g. "9.0"),
    ``sm_count`` (int, streaming multiprocessors), ``numa_node`` (int or None). Empty list on a machine
    without CUDA.
    """
    if not has_cuda():
        return []
    import torch

    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(
            {
                "index": index,
                "name": props.name,
                "memory_bytes": int(props.total_memory),
                "compute_capability": f"{props.major}.{props.minor}",
                "sm_count": int(props.multi_processor_count),
                "numa_node": _gpu_numa_node(props),
            }
        )
    return found


def check_device_name(value, name: str = "device") -> None:
    """A study parameter's check: `value` names a device a run can take ("auto", "cpu", "cuda", "cuda:N"); ValueError
    (one line) otherwise. Whether this machine has it is run_device's business, when the run is checked."""
    if not (value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", str(value))):
        raise ValueError(f"{name} = {value!r} is not a device; give 'auto', 'cpu' or 'cuda:N'")


def run_device(value: str, name: str = "device"):
    """The torch.device a study's run uses for the parameter `name` = `value`: "auto" is cuda:0, or cpu where there is
    no GPU (or KVLAB_PRESET says cpu); "cuda" is cuda:0; otherwise "cpu" or "cuda:N" as given. ValueError (one line,
    naming the value) for anything else, or for a GPU this machine does not have."""
    torch = _torch()
    if torch is None:
        raise ValueError(f"{name} = {value!r}: this study needs torch, which is not installed here")
    if value == "auto":
        try:
            value = "cpu" if preset() == "cpu" else "cuda:0"
        except RuntimeError as err:  # KVLAB_PRESET=gpu on a machine without one
            raise ValueError(f"{name} = 'auto': {err}") from None
    check_device_name(value, name)
    value = "cuda:0" if value == "cuda" else str(value)
    try:
        dev = torch.device(value)
    except RuntimeError:  # an index torch cannot hold (cuda:99999999999999999999)
        raise ValueError(f"{name} = {value!r} is not a device this machine can have; give 'auto', 'cpu' or "
                         "'cuda:N'") from None
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == "cuda" and dev.index >= n_gpu:
        raise ValueError(f"{name} = {value!r} does not exist: this machine has {n_gpu} GPU(s)")
    return dev


def free_bytes(dev) -> int | None:
    """Bytes free where `dev`'s allocations go: the GPU's free memory (cudaMemGetInfo) for a CUDA device, the host's
    available memory otherwise; None where it cannot be read."""
    torch = _torch()
    if torch is not None and getattr(dev, "type", "cpu") == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0])
        except RuntimeError:
            return None
    return host_available_bytes()


def pci_address(props, domain_digits: int = 4) -> str:
    """The PCI address of a GPU from torch's device properties, e.g. "0000:1b:00.0" (sysfs spells the
    domain with 4 hex digits, NVML with 8 and upper case: pci_address(p, 8).upper())."""
    return (f"{int(props.pci_domain_id):0{domain_digits}x}:{int(props.pci_bus_id):02x}:"
            f"{int(props.pci_device_id):02x}.0")


def _gpu_numa_node(props) -> int | None:
    """The NUMA node the GPU's PCI device hangs off (Linux sysfs), None when unknown: host memory on
    another node crosses the socket interconnect on its way to this GPU."""
    try:
        path = f"/sys/bus/pci/devices/{pci_address(props)}/numa_node"
        node = int(open(path, encoding="ascii").read().strip())
    except (AttributeError, OSError, ValueError, TypeError):
        return None
    return node if node >= 0 else None


def p2p_matrix() -> list[list[bool | None]]:
    """Peer access between visible GPUs: ``m[i][j]`` is True when device i can read/write device j
    directly (NVLink or PCIe P2P), per ``torch.cuda.can_device_access_peer``.

    The diagonal is None (a device is not its own peer). Empty list without CUDA.
    """
    if not has_cuda():
        return []
    import torch

    count = torch.cuda.device_count()
    return [
        [None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)]
        for i in range(count)
    ]


def _nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output for `args` (trailing whitespace stripped), or None: no nvidia-smi, an error, a
    timeout, or nothing printed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.rstrip() if out.returncode == 0 and out.stdout.strip() else None


def topology(gpu_count: int | None = None) -> dict | None:
    """How the GPUs are wired, as nvidia-smi reports it: ``{"matrix": <nvidia-smi topo -m>, "nvlink":
    <nvidia-smi nvlink -s>}`` (text; a value is None when that command fails). None with fewer than two
    GPUs (nothing to connect) or without nvidia-smi. Recorded in run.json so a peer bandwidth can be read
    beside the link it crossed (NV18 vs PIX vs SYS)."""
    count = gpu_count if gpu_count is not None else len(gpus())
    if count < 2 or shutil.which("nvidia-smi") is None:
        return None
    return {"matrix": _nvidia_smi("topo", "-m"), "nvlink": _nvidia_smi("nvlink", "-s")}


def driver_version() -> str | None:
    """The NVIDIA driver version (e.g. "580.159.04"), from nvidia-smi, else pynvml, else None."""
    out = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    if out:
        # One line per GPU, all the same driver: the first is the answer.
        return out.strip().splitlines()[0].strip()
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml raises its own NVMLError family when there is no driver
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def cuda_runtime() -> str | None:
    """The CUDA runtime torch was built against (``torch.version.cuda``, e.g. "13.0"); None on a
    CPU build of torch or without torch. ROCm builds report ``torch.version.hip`` as "hip <ver>"."""
    torch = _torch()
    if torch is None:
        return None
    if torch.version.cuda:
        return str(torch.version.cuda)
    hip = getattr(torch.version, "hip", None)
    return f"hip {hip}" if hip else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def host_available_bytes() -> int | None:
    """RAM the kernel says is available now (MemAvailable), falling back to free pages; None when
    unknown. What capacity checks compare a host buffer's size with before allocating it."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def host() -> dict:
    """The host: ``hostname``, ``os`` (platform string), ``cpu_model``, ``cpu_count`` (logical CPUs
    in the machine), ``cpu_usable`` (logical CPUs this process may run on), ``memory_bytes`` (total
    RAM in bytes, None when unknown)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "memory_bytes": _memory_bytes(),
    }


_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def host_state() -> dict:
    """What the host is doing now, for run.json at a run's start and end (every value None when the
    system does not say): ``loadavg`` (1, 5, 15 min), ``cpu_ticks`` (the machine's summed CPU time by
    kind since boot, in clock ticks, from /proc/stat: user, nice, system, idle, iowait, irq, softirq,
    steal — steal is time a hypervisor gave this VM's CPUs to someone else), ``cpu_mhz`` (median of the
    current clocks /proc/cpuinfo reports), ``thp`` (transparent huge pages mode), ``numa_nodes``.

    Why: at 1k tokens prefill waits for the host, and one run's host was 20 % slower and unsteady
    (run 20261129-100815-h200); two runs of the same code can only be told apart by what their host did.
    """
    out = {"loadavg": None, "cpu_ticks": None, "cpu_mhz": None, "thp": None, "numa_nodes": None}
    text = _read("/proc/loadavg")
    if text:
        try:
            out["loadavg"] = [float(x) for x in text.split()[:3]]
        except ValueError:
            pass
    text = _read("/proc/stat")
    if text:
        for line in text.splitlines():
            if line.startswith("cpu "):
                values = line.split()[1:1 + len(_CPU_FIELDS)]
                try:
                    out["cpu_ticks"] = dict(zip(_CPU_FIELDS, (int(v) for v in values)))
                except ValueError:
                    pass
                break
    text = _read("/proc/cpuinfo")
    if text:
        mhz = sorted(float(line.split(":", 1)[1]) for line in text.splitlines()
                     if line.lower().startswith("cpu mhz") and ":" in line)
        if mhz:
            out["cpu_mhz"] = mhz[len(mhz) // 2]
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text and "[" in text:
        out["thp"] = text[text.index("[") + 1:text.index("]")]
    try:
        out["numa_nodes"] = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]) or None
    except OSError:
        pass
    return out


def host_usage(start: dict, end: dict) -> dict | None:
    """Shares of the machine's CPU time between two host_state() readings, in %: busy (everything but
    idle, iowait and steal), iowait, steal; and the ticks elapsed. None when either reading lacks them."""
    a, b = (start or {}).get("cpu_ticks"), (end or {}).get("cpu_ticks")
    if not a or not b:
        return None
    delta = {k: b.get(k, 0) - a.get(k, 0) for k in _CPU_FIELDS}
    total = sum(delta.values())
    if total <= 0:
        return None
    busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
    return {"busy_pct": round(100 * busy / total, 2), "iowait_pct": round(100 * delta["iowait"] / total, 2),
            "steal_pct": round(100 * delta["steal"] / total, 2), "ticks": total}


def _dist_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages that shape a measurement; None for one not installed.

    Read from the installed distributions' metadata rather than by importing them, so asking is
    cheap and a package that is installed but broken (a triton without its compiler) cannot fail it.
    """
    found: dict[str, str | None] = {"python": platform.python_version()}
    for key, names in _PACKAGES.items():
        found[key] = _dist_version(names)
    torch = _torch()
    if torch is not None:
        # The imported module is the one that runs; metadata could describe a shadowed copy.
        found["torch"] = str(torch.__version__)
    return found


def tag_from_name(name: str) -> str:
    """A short lowercase tag for a GPU model name, for run ids: "NVIDIA H200" → "h200",
    "NVIDIA A100-SXM4-80GB" → "a100", "NVIDIA GeForce RTX 4090" → "rtx4090", "Tesla V100-SXM2-16GB"
    → "v100". Only ``[a-z0-9]`` characters; "gpu" when nothing usable is left."""
    tokens = [t for t in re.split(r"[^a-z0-9]+", name.lower()) if t and t not in _VENDOR_WORDS]
    # The model is the first token mixing letters and digits (h200, a100, l40s, mi300x, gh200).
    for token in tokens:
        if re.search(r"[a-z]", token) and re.search(r"[0-9]", token):
            return token
    # Otherwise a line name followed by a number, as in "RTX 4090".
    for first, second in zip(tokens, tokens[1:]):
        if first.isalpha() and second.isdigit():
            return first + second
    return tokens[0] if tokens else "gpu"


def device_tag() -> str:
    """The run-id tag for this machine: the first GPU's model (e.g. "h200") or "cpu"."""
    found = gpus()
    return tag_from_name(found[0]["name"]) if found else "cpu"


def describe() -> dict:
    """Everything above in one JSON-serialisable dict (the hardware part of run.json).

    Keys: ``device_kind`` ("cuda" or "cpu"), ``device_tag``, ``host``, ``devices`` (``gpus()``),
    ``p2p`` (``p2p_matrix()``), ``topology`` (``topology()``: nvidia-smi's matrix and NVLink status with two
    or more GPUs, else None), ``driver_version``, ``cuda_runtime``, ``versions``.
    """
    found = gpus()
    return {
        "device_kind": "cuda" if found else "cpu",
        "device_tag": tag_from_name(found[0]["name"]) if found else "cpu",
        "host": host(),
        "devices": found,
        "p2p": p2p_matrix(),
        "topology": topology(len(found)),
        "driver_version": driver_version(),
        "cuda_runtime": cuda_runtime(),
        "versions": versions(),
    }


def summary(info: dict) -> str:
    """One short line naming the hardware of a ``describe()`` record (or a run.json, which holds
    the same keys): "NVIDIA H200", "2× NVIDIA H100 80GB HBM3", or "cpu" for a CPU run."""
    if info.get("device_kind") != "cuda" or not info.get("devices"):
        return "cpu"
    names = [d["name"] for d in info["devices"]]
    if len(set(names)) == 1:
        return names[0] if len(names) == 1 else f"{len(names)}× {names[0]}"
    return " + ".join(names)
