"""Collectives priced by algorithm on a cluster's links.

A mesh axis's groups are laid out on the cluster's nodes by rank order: ranks are numbered
row-major over the mesh (the last axis varies fastest) and fill nodes in order, so the
innermost axes stay inside a node.  :func:`axis_span` says, for one axis, how many members
of a group share a node (``per_node``) and how many nodes a group spans (``nodes``).

Times, for a step that sends ``nbytes`` from the busiest rank (the
:class:`~layout_prop.core.redistribute.Step` convention: ``(n-1)/n`` of the buffer for an
all-gather or reduce-scatter or all-to-all, twice that for an all-reduce):

- inside a node: a ring, ``nbytes / B_intra + hops * latency`` (``hops`` = n - 1, twice for
  an all-reduce); an all-reduce takes the better of the ring and a tree
  (``2 ceil(log2 n)`` latencies, twice the buffer over the link);
- across nodes only (one member per node): the same over the inter-node links;
- both (``per_node`` g > 1 members on each of ``nodes`` m > 1 nodes): hierarchical. An
  all-reduce reduce-scatters inside the node, all-reduces 1/g of the buffer across nodes
  (each device on its own rail) and all-gathers inside the node; an all-gather or
  reduce-scatter moves the ``(m-1)`` remote pieces over the rails and ``(g-1)`` pieces of
  ``m`` times the size inside; an all-to-all sends ``n-g`` of its ``n-1`` blocks across nodes.

A ``permute`` (point-to-point: pipeline stages, a ring's shift) is one link transfer,
``nbytes / B + latency``, over the intra-node link when a group of the axis fits in one node
and over the inter-node link when it spans several (some pair then crosses nodes, and the
slowest pair sets the step's time).

Bandwidths are the profile's times its ``link_efficiency``.

Examples
--------
>>> from layout_prop.perf.clusters import get_cluster
>>> a100 = get_cluster("a100-80g")
>>> axis_span((4, 8), 1, 8), axis_span((4, 8), 0, 8), axis_span((2, 16), 1, 8)
((8, 1), (1, 4), (8, 2))
>>> round(collective_time("all-gather", 7 * 2**20, (8,), 0, a100) * 1e6, 1)  # 7 MiB inside a node: us
51.6
"""

from __future__ import annotations

import math

from .clusters import Cluster, Network

__all__ = ["axis_span", "collective_time", "KINDS"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "permute", "local-partial", "local-slice")


def axis_span(mesh_shape: tuple[int, ...], axis: int, devices_per_node: int) -> tuple[int, int]:
    """``(per_node, nodes)``: members of one group of mesh axis ``axis`` on a node, and nodes a group spans."""
    n = mesh_shape[axis]
    stride = math.prod(mesh_shape[axis + 1:])
    if n == 1:
        return 1, 1
    if stride >= devices_per_node:
        return 1, n
    per_node = max(1, min(n, devices_per_node // stride))
    return per_node, math.ceil(n / per_node)


def _ring(nbytes: float, hops: int, link: Network, eff: float) -> float:
    return nbytes / (link.GBps * 1e9 * eff) + hops * link.latency_us * 1e-6


def collective_time(kind: str, nbytes: float, mesh_shape: tuple[int, ...], axis: int, cluster: Cluster) -> float:
    """Seconds one collective step of ``kind`` on mesh axis ``axis`` takes (module docstring)."""
    if kind in ("local-slice", "local-partial") or nbytes <= 0:
        return 0.0
    n = mesh_shape[axis]
    if n <= 1:
        return 0.0
    g, m = axis_span(mesh_shape, axis, cluster.devices_per_node)
    eff = cluster.link_efficiency
    if kind == "permute":
        return _ring(nbytes, 1, cluster.intra if m == 1 else cluster.inter, eff)
    if m == 1 or g == 1:
        link = cluster.intra if m == 1 else cluster.inter
        if kind == "all-reduce":
            ring = _ring(nbytes, 2 * (n - 1), link, eff)
            buffer = nbytes * n / (2 * (n - 1))
            tree = 2 * buffer / (link.GBps * 1e9 * eff) + 2 * math.ceil(math.log2(n)) * link.latency_us * 1e-6
            return min(ring, tree)
        return _ring(nbytes, n - 1, link, eff)
    intra, inter = cluster.intra, cluster.inter
    if kind == "all-reduce":
        buffer = nbytes * n / (2 * (n - 1))
        inside = 2 * _ring(buffer * (g - 1) / g, g - 1, intra, eff)  # reduce-scatter, then all-gather
        across = _ring(2 * (m - 1) / m * buffer / g, 2 * (m - 1), inter, eff)
        return inside + across
    piece = nbytes / (n - 1)
    if kind in ("all-gather", "reduce-scatter"):
        return _ring((m - 1) * piece, m - 1, inter, eff) + _ring((g - 1) * m * piece, g - 1, intra, eff)
    if kind == "all-to-all":
        return _ring((n - g) * piece, m - 1, inter, eff) + _ring((g - 1) * piece, g - 1, intra, eff)
    raise ValueError(f"unknown collective kind {kind!r}")
