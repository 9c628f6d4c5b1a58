"""A cluster fabric as capacity-limited directed links, and the route a flow takes between two GPUs.

Model (every capacity is one direction, in bytes per second, decimal units as links are quoted):

* each GPU has a NIC with a transmit link (``nic-tx``) and a receive link (``nic-rx``) of
  ``nic_gbit_s`` Gb/s each, so sending and receiving do not compete;
* GPUs of one node talk over NVLink through the node's NVSwitch: a GPU's ``nvlink-tx`` and
  ``nvlink-rx`` of ``nvlink_gbyte_s`` GB/s each; intra-node traffic never touches the NIC;
* ``nodes_per_leaf`` nodes hang off one leaf switch; traffic between leaves climbs the source
  leaf's uplink (``leaf-up``) and descends the destination leaf's downlink (``leaf-down``), each of
  ``(GPUs under the leaf · NIC rate) / oversubscription``; the spine itself is non-blocking (ECMP
  taken as ideal), so an oversubscribed fabric is an uplink bottleneck, not a spine one;
* optionally (``pcie_gbyte_s``) each GPU's PCIe link to its switch, ``pcie-up`` (GPU → host/NIC)
  and ``pcie-down``: crossed by host copies (``"host3"`` endpoints) and by NIC traffic, which
  reaches the NIC through the GPU's PCIe link (GPUDirect RDMA).

A route is the list of link indices a flow crosses, in order (at most :data:`MAX_HOPS`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["MAX_HOPS", "TopologyConfig", "Topology", "LINK_KINDS"]

# pcie-up, nic-tx, leaf-up, leaf-down, nic-rx, pcie-down: the longest route there is.
MAX_HOPS = 6
LINK_KINDS = ("nic-tx", "nic-rx", "nvlink-tx", "nvlink-rx", "leaf-up", "leaf-down", "pcie-up", "pcie-down")

_ENDPOINT_RE = re.compile(r"^(gpu|host)(\d+)$")


def _check_int(name: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}={value!r}: must be an integer ≥ {low}")


def _check_rate(name: str, value: Any, low: float = 0.0, strict: bool = True) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        raise ValueError(f"{name}={value!r}: must be a finite number {'>' if strict else '≥'} {low:g}")


@dataclass(frozen=True)
class TopologyConfig:
    """The fabric's shape and link rates (validated on construction).

    Fields:
        gpus: GPUs in the cluster (≥ 1), a multiple of ``gpus_per_node``.
        gpus_per_node: GPUs sharing one NVSwitch (≥ 1).
        nodes_per_leaf: nodes under one leaf switch (≥ 1); the last leaf may hold fewer.
        nic_gbit_s: each GPU's NIC, Gb/s per direction (bits, as NICs are quoted: 400 → 50e9 B/s).
        nvlink_gbyte_s: each GPU's NVLink bandwidth through the switch, GB/s per direction.
        oversubscription: a leaf's downlink capacity over its uplink capacity (≥ 1; 1 = non-blocking).
        pcie_gbyte_s: each GPU's PCIe link, GB/s per direction, or None for no PCIe link in the model.
    """

    gpus: int = 16
    gpus_per_node: int = 8
    nodes_per_leaf: int = 4
    nic_gbit_s: float = 400.0
    nvlink_gbyte_s: float = 450.0
    oversubscription: float = 1.0
    pcie_gbyte_s: float | None = None

    def __post_init__(self) -> None:
        _check_int("topology.gpus", self.gpus)
        _check_int("topology.gpus_per_node", self.gpus_per_node)
        _check_int("topology.nodes_per_leaf", self.nodes_per_leaf)
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"topology.gpus={self.gpus} is not a multiple of gpus_per_node="
                             f"{self.gpus_per_node}: a node is a whole unit")
        _check_rate("topology.nic_gbit_s", self.nic_gbit_s)
        _check_rate("topology.nvlink_gbyte_s", self.nvlink_gbyte_s)
        ok = (isinstance(self.oversubscription, numbers.Real) and not isinstance(self.oversubscription, bool)
              and math.isfinite(self.oversubscription) and self.oversubscription >= 1)
        if not ok:
            raise ValueError(f"topology.oversubscription={self.oversubscription!r}: must be a finite number ≥ 1 "
                             "(1 = non-blocking)")
        if self.pcie_gbyte_s is not None:
            _check_rate("topology.pcie_gbyte_s", self.pcie_gbyte_s)

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def leaves(self) -> int:
        return -(-self.nodes // self.nodes_per_leaf)

    def with_(self, **changes: Any) -> TopologyConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


class Topology:
    """The links of a :class:`TopologyConfig` and the routes between its GPUs.

    Attributes:
        config: the TopologyConfig.
        capacity: float64 array ``(n_links,)``, bytes per second per link.
        names: ``n_links`` labels (``"nic-tx/g3"``, ``"leaf-up/l0"``).
        kinds: ``n_links`` kinds from :data:`LINK_KINDS`.
        max_hops: the longest route (:data:`MAX_HOPS`).
    """

    max_hops = MAX_HOPS

    def __init__(self, config: TopologyConfig | None = None) -> None:
        config = TopologyConfig() if config is None else config
        if not isinstance(config, TopologyConfig):
            raise ValueError(f"config={config!r}: expected a TopologyConfig")
        self.config = c = config
        g, leaves = c.gpus, c.leaves
        nic = c.nic_gbit_s * 1e9 / 8
        names: list[str] = []
        kinds: list[str] = []
        caps: list[float] = []

        def block(kind: str, count: int, tag: str, cap: Any) -> int:
            first = len(names)
            for i in range(count):
                names.append(f"{kind}/{tag}{i}")
                kinds.append(kind)
                caps.append(cap(i) if callable(cap) else cap)
            return first

        self._nic_tx = block("nic-tx", g, "g", nic)
        self._nic_rx = block("nic-rx", g, "g", nic)
        self._nvl_tx = block("nvlink-tx", g, "g", c.nvlink_gbyte_s * 1e9)
        self._nvl_rx = block("nvlink-rx", g, "g", c.nvlink_gbyte_s * 1e9)

        def uplink(leaf: int) -> float:
            nodes_here = min(c.nodes_per_leaf, c.nodes - leaf * c.nodes_per_leaf)
            return nodes_here * c.gpus_per_node * nic / c.oversubscription

        self._leaf_up = block("leaf-up", leaves, "l", uplink)
        self._leaf_down = block("leaf-down", leaves, "l", uplink)
        self._pcie_up = self._pcie_down = -1
        if c.pcie_gbyte_s is not None:
            self._pcie_up = block("pcie-up", g, "g", c.pcie_gbyte_s * 1e9)
            self._pcie_down = block("pcie-down", g, "g", c.pcie_gbyte_s * 1e9)
        self.names = names
        self.kinds = kinds
        self.capacity = np.asarray(caps, dtype=np.float64)

    @property
    def n_links(self) -> int:
        return len(self.names)

    def node_of(self, gpu: int) -> int:
        return gpu // self.config.gpus_per_node

    def leaf_of(self, gpu: int) -> int:
        return self.node_of(gpu) // self.config.nodes_per_leaf

    def _endpoint(self, name: str, x: Any) -> tuple[str, int]:
        if isinstance(x, numbers.Integral) and not isinstance(x, bool):
            kind, idx = "gpu", int(x)
        elif isinstance(x, str) and (m := _ENDPOINT_RE.match(x.strip().lower())):
            kind, idx = m[1], int(m[2])
        else:
            raise ValueError(f"{name}={x!r}: expected a GPU index, 'gpuN' or 'hostN' (the host memory behind GPU N)")
        if not 0 <= idx < self.config.gpus:
            raise ValueError(f"{name}={x!r}: GPU index out of range 0…{self.config.gpus - 1}")
        if kind == "host" and self._pcie_up < 0:
            raise ValueError(f"{name}={x!r}: a host endpoint needs a PCIe link (topology.pcie_gbyte_s is None)")
        return kind, idx

    def route(self, src: Any, dst: Any) -> list[int]:
        """Link indices a flow from ``src`` to ``dst`` crosses, in order.

        Endpoints: a GPU index (or ``"gpuN"``), or ``"hostN"`` — host memory behind GPU N's PCIe link.
        Same node: NVLink; another node: the NIC (through PCIe when the model has it) and, across
        leaves, the two leaves' up- and downlinks. Host ↔ its own GPU: that GPU's PCIe link.
        ``src == dst`` → ValueError (a copy inside one GPU crosses no link of the fabric).
        """
        (sk, s), (dk, d) = self._endpoint("src", src), self._endpoint("dst", dst)
        if (sk, s) == (dk, d):
            raise ValueError(f"src={src!r} and dst={dst!r} are the same endpoint: no link of the fabric is crossed")
        if sk == "host" or dk == "host":
            if s != d:
                raise ValueError(f"src={src!r}, dst={dst!r}: a host endpoint talks only to the GPU it is attached to")
            return [self._pcie_up + s] if sk == "gpu" else [self._pcie_down + d]
        if self.node_of(s) == self.node_of(d):
            return [self._nvl_tx + s, self._nvl_rx + d]
        out = [self._nic_tx + s]
        ls, ld = self.leaf_of(s), self.leaf_of(d)
        if ls != ld:
            out += [self._leaf_up + ls, self._leaf_down + ld]
        out.append(self._nic_rx + d)
        if self._pcie_up >= 0:
            out = [self._pcie_up + s, *out, self._pcie_down + d]
        return out

    def bottleneck(self, route: list[int]) -> float:
        """The smallest capacity on ``route``, bytes/s: the rate one flow alone achieves on it."""
        return float(self.capacity[route].min())

    def link_table(self) -> pd.DataFrame:
        """One row per link: ``link`` (index), ``name``, ``kind``, ``capacity_gbyte_s`` (GB/s)."""
        return pd.DataFrame({"link": np.arange(self.n_links), "name": self.names, "kind": self.kinds,
                             "capacity_gbyte_s": self.capacity / 1e9})
