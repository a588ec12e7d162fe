"""The mesh's links: bandwidth and latency per mesh axis, as a spec's ``mesh.links`` gives them.

The loader reads them into ``graph.meta["links"]``; the planner prices collectives with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SpecError, cut
from .graph import Graph
from . import meta

__all__ = ["Link", "DEFAULT_LINK", "LINK_BOUNDS", "parse_links", "links_of"]


@dataclass(frozen=True)
class Link:
    """A mesh axis's links: bandwidth in GB/s (1e9 bytes per second) and latency per hop in us."""

    GBps: float
    latency_us: float


DEFAULT_LINK = Link(GBps=100.0, latency_us=5.0)

#: the figures a link may have, (low, high) inclusive.  A link slower than 1 kB/s or faster
#: than 1 PB/s, or a latency over 1000 s a hop, is a typing error; within the bounds every
#: cost is a finite float, and for tensors up to a terabyte far below the 1e20 that HiGHS
#: takes for an infinite cost: one move of 1 TB at 1e-6 GB/s is 1e15 us, its latency at most
#: 2 * 65,535 hops * 1e9 us.  (A subnormal GBps such as 1e-320 made bytes / GBps infinite,
#: and GBps 1e-300 with 1e300 us of latency left the solver without a solution.)
LINK_BOUNDS = {"GBps": (1e-6, 1e6), "latency_us": (0.0, 1e9)}


def parse_links(data: Any, mesh) -> dict[str, Link]:
    """The ``links`` of a spec's mesh (``{tp: {GBps: 196, latency_us: 2}}``), checked.

    Axes not named get :data:`DEFAULT_LINK`'s figures, and so do keys left out.

    >>> from layout_prop import DeviceMesh
    >>> parse_links({"tp": {"GBps": 196}}, DeviceMesh((2, 2), ("dp", "tp")))["tp"]
    Link(GBps=196.0, latency_us=5.0)
    """
    out = {name: DEFAULT_LINK for name in mesh.names}
    if data is None:
        return out
    if not isinstance(data, dict):
        raise SpecError("bad-type", f"mesh links must be a mapping of axis -> {{GBps, latency_us}}, got {data!r}",
                        path="mesh.links", hint="write links: {tp: {GBps: 196, latency_us: 2}}")
    for axis, link in data.items():
        path = f"mesh.links.{axis}"
        if axis not in mesh.names:
            raise SpecError("unknown-key", f"links name mesh axis {axis!r}, which the mesh does not have",
                            path=path, hint=f"the mesh axes are {list(mesh.names)}")
        if not isinstance(link, dict) or set(link) - {"GBps", "latency_us"}:
            raise SpecError("bad-value", f"a link is {{GBps, latency_us}}, got {link!r}", path=path,
                            hint="write {GBps: 196, latency_us: 2}")
        gbps = link.get("GBps", DEFAULT_LINK.GBps)
        latency = link.get("latency_us", DEFAULT_LINK.latency_us)
        for key, value in (("GBps", gbps), ("latency_us", latency)):
            low, high = LINK_BOUNDS[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise SpecError("bad-value", f"{key} of {axis!r} is {cut(value)}, outside [{low:g}, {high:g}]",
                                path=f"{path}.{key}", hint=f"GBps is a number in [{LINK_BOUNDS['GBps'][0]:g}, "
                                f"{LINK_BOUNDS['GBps'][1]:g}] (GB/s; 25 for a PCIe link, 900 for NVLink), latency_us "
                                f"one in [{LINK_BOUNDS['latency_us'][0]:g}, {LINK_BOUNDS['latency_us'][1]:g}] "
                                "(microseconds per hop)")
        out[axis] = Link(float(gbps), float(latency))
    return out


def links_of(graph: Graph) -> dict[str, Link]:
    """The graph's links (set by the loader from ``mesh.links``), defaults elsewhere."""
    return graph.meta.get(meta.LINKS) or parse_links(None, graph.mesh)
