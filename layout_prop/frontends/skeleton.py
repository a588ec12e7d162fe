"""``layout-prop import MODEL`` without a plan: the names a plan may match, and a plan skeleton.

A user starting from a model file does not know the names its weights have after import
(torch's module names, the exporter's own, a de-duplicated tensor's several names) nor how
each is consumed.  :func:`describe_model` imports the model without a plan and lists every
trainable parameter (its name, shape, the op consuming it and a suggested preset) and every
graph input; :func:`skeleton_yaml` writes them as a sharding plan to edit.

The suggested preset follows Megatron's pairing: a weight of a product (``matmul``,
``linear``) is ``colwise`` unless the product's input comes (through reshapes, transposes,
casts) from an attention or an activation (``scaled_dot_product_attention``, ``silu_mul``,
``gelu``, ``silu``, ``relu``...), the second half of an attention or MLP block, which is
``rowwise``; an embedding table is ``vocab``; any other parameter (a norm weight, a bias) is
``R``.  A suggestion is a start: the mesh in the skeleton is a placeholder of one ``tp`` axis
of 2 devices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .ir import parameter_uses

__all__ = ["ParameterRow", "InputRow", "describe_model", "skeleton_yaml", "format_rows"]

#: ops whose output feeds the second product of a Megatron pair (that product is row-parallel)
_SECOND_HALF = {"scaled_dot_product_attention", "flash_attention_score", "silu_mul", "swiglu", "gelu", "gelu_erf",
                "silu", "relu", "sigmoid", "tanh"}
#: ops followed backwards from a product's input to the op that computed it
_PASS_THROUGH = {"reshape", "transpose", "cast", "identity", "squeeze", "unsqueeze", "redistribute"}


@dataclass(frozen=True)
class ParameterRow:
    """One trainable parameter of an imported model."""

    name: str
    shape: tuple[int, ...]
    consumer: str
    preset: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class InputRow:
    """One graph input (not a weight) of an imported model."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def _through_moves(producers: dict[str, dict], value: str) -> list[str]:
    """``value`` and the values it is computed from by reshapes, transposes and casts, nearest first."""
    chain = [value]
    while len(chain) < 64:
        nd = producers.get(chain[-1])
        if nd is None or nd["op"] not in _PASS_THROUGH or not nd["inputs"]:
            break
        chain.append(nd["inputs"][0])
    return chain


def _suggest(spec: dict, producers: dict[str, dict], name: str, uses) -> tuple[str, str]:
    """``(consumer op, suggested preset)`` of parameter ``name``: ``vocab`` for an embedding table,
    ``rowwise`` for the weight of a product whose input comes from attention or an activation,
    ``colwise`` for another product's, ``R`` for the rest."""
    if any(u.embedding for u in uses):
        return "embedding", "vocab"
    if not uses:
        first = next((nd["op"] for nd in spec["nodes"] if name in nd["inputs"]), "-")
        return first, "R"
    product = next((nd for nd in spec["nodes"] if nd["op"] == uses[0].op and len(nd["inputs"]) > 1 and
                    name in _through_moves(producers, nd["inputs"][1])), None)
    source = producers.get(_through_moves(producers, product["inputs"][0])[-1]) if product is not None else None
    if source is not None and source["op"] in _SECOND_HALF:
        return uses[0].op, "rowwise"
    width = spec["inputs"][name]["shape"][uses[0].out_dim]
    blocks = _fused_blocks(spec, product, width) if product is not None else None
    return uses[0].op, f"colwise_fused({blocks})" if blocks else "colwise"


def _fused_blocks(spec: dict, product: dict, width: int) -> int | None:
    """K when the product's output (through a bias add, reshapes, casts) is cut into K equal
    pieces along its last dim, by one split or chunk (GPT-2's ``c_attn`` into q, k and v) or by K
    slices that tile it (Phi-3's ``qkv_proj`` and ``gate_up_proj``): a fused projection, column
    parallel as Megatron shards it with ``colwise_fused(K)``; else None.

    ``width`` is the weight's output features, the size of the product's last dim: where the
    spec does not give the cut value's rank, a cut whose pieces add up to ``width`` is taken
    to be along that dim.
    """
    from layout_prop.io.plan_file import PRESETS

    if "colwise_fused" not in PRESETS:
        return None
    consumers: dict[str, list[dict]] = {}
    for nd in spec["nodes"]:
        for v in nd["inputs"]:
            consumers.setdefault(v, []).append(nd)
    value = product["name"]
    for _ in range(16):
        after = consumers.get(value, [])
        if len(after) == 1 and after[0]["op"] in ("add", "reshape", "cast", "identity"):
            value = after[0]["name"]
            continue
        rank = len(_spec_shape(spec, value) or ())
        if len(after) == 1:
            return _split_blocks(after[0], rank, width)
        return _slice_blocks(after, rank, width)
    return None


def _on_last_dim(axis, rank: int, total: int, width: int) -> bool:
    """Whether a cut along ``axis`` whose pieces add up to ``total`` cuts the product's last dim."""
    if axis is None:
        return False
    return axis % rank == rank - 1 if rank else (axis >= 0 and total == width)


def _split_blocks(nd: dict, rank: int, width: int) -> int | None:
    """K for a ``splitK``/``chunkK`` node into equal pieces along the last dim, else None."""
    op = nd["op"]
    k = op[len("split"):] if op.startswith("split") else op[len("chunk"):] if op.startswith("chunk") else ""
    if not k.isdigit():
        return None
    sizes = nd["attrs"].get("sizes")
    axis = nd["attrs"].get("axis", nd["attrs"].get("dim"))
    if sizes is not None and len(set(sizes)) != 1:
        return None
    total = sum(sizes) if sizes is not None else width
    return int(k) if _on_last_dim(axis, rank, total, width) else None


def _slice_blocks(nodes: list[dict], rank: int, width: int) -> int | None:
    """K when ``nodes`` are K >= 2 slices along one axis tiling ``[0, width)`` in equal pieces, else None."""
    if len(nodes) < 2 or any(nd["op"] != "slice" for nd in nodes):
        return None
    axes = {nd["attrs"].get("axis") for nd in nodes}
    ranges = sorted((nd["attrs"].get("start", 0), nd["attrs"].get("stop")) for nd in nodes)
    if len(axes) != 1 or any(not isinstance(a, int) or not isinstance(b, int) or a < 0 or b <= a for a, b in ranges):
        return None
    size = ranges[0][1] - ranges[0][0]
    tiles = all(lo == i * size and hi == (i + 1) * size for i, (lo, hi) in enumerate(ranges))
    if not tiles or size * len(ranges) != width or not _on_last_dim(axes.pop(), rank, width, width):
        return None
    return len(ranges)


def _spec_shape(spec: dict, value: str) -> tuple[int, ...] | None:
    """The shape of ``value`` where the spec says it: a reshape's ``shape`` attr or an input's shape."""
    if value in spec["inputs"]:
        return tuple(spec["inputs"][value]["shape"])
    nd = next((n for n in spec["nodes"] if n["name"] == value), None)
    return tuple(nd["attrs"]["shape"]) if nd is not None and nd["op"] == "reshape" else None


def describe_model(path: str | Path, *, opaque: bool = False, fuse: bool = True
                   ) -> tuple[list[ParameterRow], list[InputRow], list[str]]:
    """Import ``path`` without a plan: its parameters, its graph inputs and the import notes.

    Raises
    ------
    SpecError, OpError
        As an import with a plan does (``dynamic-shape`` for a dynamic input dim: a plan must
        give its shape, so write the skeleton by hand for such a model).
    """
    from ..core.graph import paused_gc
    from . import read_model
    from .canonicalize import Canonicalize
    from .ir import to_spec
    from . import pointwise as _pointwise  # noqa: F401  (registers sqrt, sigmoid... and the opaque op)

    with paused_gc():
        model = read_model(path, None)
        if fuse:
            Canonicalize().run(model)
        spec, weights = to_spec(model, opaque=opaque)
    uses = parameter_uses(spec, weights)
    producers = {nd["name"]: nd for nd in spec["nodes"]}
    params = []
    for w in weights:
        consumer, preset = _suggest(spec, producers, w, uses[w])
        params.append(ParameterRow(w, tuple(spec["inputs"][w]["shape"]), consumer, preset,
                                   tuple(model.spec_aliases.get(w, ()))))
    weight_set = set(weights)
    inputs = [InputRow(n, tuple(e["shape"]), e["dtype"]) for n, e in spec["inputs"].items()
              if n not in weight_set and n not in model.spec_sources]
    return params, inputs, list(model.notes)


def format_rows(params: list[ParameterRow], inputs: list[InputRow]) -> str:
    """The parameters and inputs as a table (what ``import MODEL`` prints)."""
    header = ("parameter", "shape", "consumer", "suggested")
    rows = [(p.name + (" *" if p.aliases else ""), str(list(p.shape)), p.consumer, p.preset) for p in params]
    widths = [max([len(h)] + [len(r[k]) for r in rows]) for k, h in enumerate(header)]
    lines = [f"{len(params)} parameter(s):"]
    for row in [header] + rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    for p in params:
        if p.aliases:
            lines.append(f"  * one tensor the exporter de-duplicated, also named {', '.join(p.aliases)}")
    lines.append(f"{len(inputs)} input(s):")
    cells = [(i.name, str(list(i.shape)), i.dtype) for i in inputs]
    widths = [max([0] + [len(c[k]) for c in cells]) for k in range(3)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines) + "\n"


def skeleton_yaml(params: list[ParameterRow], inputs: list[InputRow], model: str) -> str:
    """A sharding plan to edit: a placeholder mesh, every input replicated, every parameter with
    its suggested preset and a comment giving its shape and consumer."""
    lines = [f"# a sharding plan for {model}, written by layout-prop import without --plan:",
             "# set the mesh, then edit the inputs' placements and the parameters' presets",
             "mesh: {shape: [2], names: [tp]}",
             "inputs:" + ("" if inputs else " {}")]
    for i in inputs:
        lines.append(f"  {json.dumps(i.name)}: R  # {list(i.shape)} {i.dtype}")
    lines.append("parameters:" + ("" if params else " {}"))
    for p in params:
        also = f"; shared: also {', '.join(p.aliases)}" if p.aliases else ""
        lines.append(f"  {json.dumps(p.name)}: {p.preset}  # {list(p.shape)}, read by {p.consumer}{also}")
    return "\n".join(lines) + "\n"
