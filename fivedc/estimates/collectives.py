"""Seconds of one collective over its group's links, by the algorithm NCCL would run.

Ring all-reduce 2(n-1)/n x bytes, all-gather, reduce-scatter and all-to-all (n-1)/n x
bytes, send/recv the bytes, at NVLink bandwidth when the group sits in one node and
at the network's otherwise (where the group has g GPUs in each node, g NICs carry it),
plus a latency per algorithm step: NVLink's for a ring's steps inside a node, the
network's for the one step a node that crosses between nodes. Where NCCL runs them
(`Hardware.tree_all_reduce`) an all-reduce across nodes takes the faster of the ring and
NCCL's double binary tree (2 x the bytes at 0.9 of the bandwidth, a latency of log2 of the
nodes each way), as NCCL's tuning model picks: the tree for small sums over many nodes.
Which ranks share a node follows from the rank order (`Mesh.group_ranks`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from fivedc.ir.graph import CollectiveKind
from fivedc.ir.hardware import Hardware
from fivedc.ir.mesh import Mesh

K = CollectiveKind


@functools.lru_cache(maxsize=4096)
def node_span(mesh: Mesh, axes: tuple, gpus_per_node: int) -> tuple[int, int]:
    """(nodes the group of `axes` spans, its members per node), for the group of rank 0:
    its members are the sums of each axis's coordinate times its stride (what
    `Mesh.group_ranks(axes, 0)` lists), counted here as an array (a 16384-rank group in
    microseconds), once per mesh, group and node size (the layout search asks for each
    many times)."""
    members = np.zeros(1, dtype=np.int64)
    for axis in axes:
        members = np.add.outer(members, np.arange(mesh.size(axis), dtype=np.int64) * mesh.stride(axis)).ravel()
    nodes = int(np.unique(members // gpus_per_node).size)
    return nodes, max(members.size // nodes, 1)


def collective_seconds(kind: CollectiveKind, axes: tuple, nbytes: float, mesh: Mesh, hw: Hardware,
                       members: int | None = None) -> float:
    """`members`: the group has only that many of the axes' ranks (a tied weight's pp holders)."""
    n = mesh.size(*axes) if members is None else members
    if n == 1 or kind == K.SLICE:
        return 0.0
    nodes, per_node = node_span(mesh, axes, hw.gpus_per_node)
    nodes = min(nodes, n)
    if nodes == 1:
        bandwidth = hw.nvlink_bytes_per_s
    elif kind == K.SEND_RECV:  # one GPU to one GPU: through its own NIC (a ring's step waits on its slowest hop)
        bandwidth = min(hw.nvlink_bytes_per_s, hw.internode_bytes_per_s)
    else:  # the group's members on a node drive their NICs together (NCCL's rings over them)
        bandwidth = min(hw.nvlink_bytes_per_s, per_node * hw.internode_bytes_per_s)
    bandwidth *= hw.link_efficiency
    if kind == K.SEND_RECV:
        return nbytes / bandwidth + (hw.nvlink_latency_s if nodes == 1 else hw.internode_latency_s)
    if kind == K.ALL_REDUCE:
        ring = 2 * (n - 1) / n * nbytes / bandwidth + 2 * _ring_latency(n, nodes, hw)
        return min(ring, _tree_all_reduce(nbytes, bandwidth, n, nodes, hw)) if hw.tree_all_reduce else ring
    return (n - 1) / n * nbytes / bandwidth + _ring_latency(n, nodes, hw)


def _ring_latency(n: int, nodes: int, hw: Hardware) -> float:
    """A ring's n - 1 steps: those crossing between nodes (one a node) wait on the network's
    latency, the rest on NVLink's (NCCL's tuning model, src/graph/tuning.cc)."""
    return (n - nodes) * hw.nvlink_latency_s + (nodes - 1) * hw.internode_latency_s


# NCCL's tuning model (src/graph/tuning.cc) prices a tree's bus bandwidth at 0.9 of the links'.
TREE_BANDWIDTH = 0.9


def _tree_all_reduce(nbytes: float, bandwidth: float, n: int, nodes: int, hw: Hardware) -> float:
    """NCCL's double binary tree across nodes (a chain inside each), reduce then broadcast,
    pipelined: every byte up and down (2 x nbytes at 0.9 of the bandwidth), and a latency of
    the trees' depth, log2 of the nodes, and the chain's, each way. NCCL takes the faster of
    it and the ring: the tree for small sums over many nodes, the ring for large ones."""
    if nodes == 1:
        return math.inf
    depth = (n // nodes - 1) * hw.nvlink_latency_s + math.ceil(math.log2(nodes)) * hw.internode_latency_s
    return 2 * nbytes / (TREE_BANDWIDTH * bandwidth) + 2 * depth
