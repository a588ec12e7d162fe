"""canonicalize: fuse the decomposed patterns of imported models into the registry's ops.

Compiler-style pattern rewrites over an importer's
:class:`~layout_prop.frontends.ir.ModelGraph` (before lowering to a spec, so the
decomposed ops the registry does not know, such as ``pow`` or ``rsqrt``, may appear).
Each rewrite replaces the last node of a matched chain by the fused op, in place (so every
input is still defined before it), when every intermediate value of the chain is used
by the chain only; dead nodes are pruned at the end.  The rewrites, in order:

``identity``
    ``identity`` and a ``cast`` to the dtype the value already has are bypassed.
``dense``
    ``reshape(linear(reshape(x, (-1, in)), w[, b]), lead + (out,))`` (a MindSpore ``Dense``
    on an input of rank > 2; the bias as an ``add``) -> ``linear(x, w[, b])`` on the
    unflattened input (``x``'s trailing dims merged to ``in`` first when they are several,
    as the heads before an output projection).
``silu``
    ``x * sigmoid(x)`` -> ``silu(x)``.
``rms_norm``
    ``w * (x * rsqrt(mean(x**2, -1, keepdim) + eps))`` (``x*x`` for the square;
    ``reciprocal(sqrt(.))``, ``1 / sqrt(.)`` or ``x / sqrt(.)`` for the inverse root;
    either operand order of the products; computed in float32 between two casts, as
    Hugging Face's LlamaRMSNorm does for a float16 model) -> ``rms_norm(x, w, eps)``.
``rope``
    ``x * cos + rotate(x) * sin`` with rotate-half (``concat(-x[..., D/2:], x[..., :D/2])``)
    -> ``rotary_position_embedding(x, cos, sin, mode=0)``, with the interleaved rotation
    (``reshape(concat(-x[..., 1::2, None], x[..., ::2, None]))``) -> ``mode=1``.
``silu_mul``
    ``silu(a) * b`` -> ``silu_mul(a, b)``.
``gelu``
    ``x * 0.5 * (1 + erf(x / sqrt(2)))`` (either order of the products) -> ``gelu_erf(x)``;
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` (GPT-2's, Gemma's) -> ``gelu(x)``
    (the registry's gelu is the tanh approximation).
``batched_transpose``
    ``reshape(transpose(reshape(x, (B*N, S, D)), [0, 2, 1]), (B, N, D, S))`` (torch's ``k^T`` after
    grouped-query heads were repeated) -> ``transpose(reshape(x, (B, N, S, D)), [0, 1, 3, 2])``.
``attention``
    ``softmax(q @ k^T * c + mask) @ v`` on 4-D BNSD tensors (or with ``q`` and ``k^T`` each
    scaled by a constant, as torch exports ``scaled_dot_product_attention``), with ``mask`` absent or a
    constant that is exactly top-left causal (0 where key <= query, at most -1e4
    elsewhere; or the same as a ``where`` with such a fill), the softmax optionally guarded by
    ``where(isnan(p), 0, p)`` as torch's decomposition writes it ->
    ``scaled_dot_product_attention(q, k, v, layout="BNSD", causal, scale=c)``.  Attention with any
    other additive bias (BERT's padding mask, T5's relative-position bias) is left unfused: the
    registry's attention takes no bias operand.

Examples
--------
>>> import numpy as np
>>> from layout_prop.frontends.ir import ModelGraph, MNode, Value
>>> g = ModelGraph("test")
>>> for name in ("x", "s", "y"):
...     _ = g.add_value(Value(name, (2, 4), "float32"))
>>> g.inputs, g.outputs = ["x"], ["y"]
>>> g.nodes = [MNode("s", "sigmoid", ["x"], ["s"]), MNode("y", "mul", ["x", "s"], ["y"])]
>>> Canonicalize().run(g).fused
{'silu': 1}
>>> [(n.op, n.inputs) for n in g.nodes]
[('silu', ['x'])]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from layout_prop.frontends.ir import MNode, ModelGraph, Value, scalar_value

__all__ = ["Canonicalize", "CanonicalizeResult", "REWRITES", "is_causal_mask"]


@dataclass
class CanonicalizeResult:
    """How many times each rewrite fired."""

    fused: dict[str, int] = field(default_factory=dict)


class _View:
    """Producers and uses of a model graph, built once per rewrite sweep."""

    def __init__(self, g: ModelGraph) -> None:
        self.g = g
        self.prod = g.producers()
        self.uses = g.uses()
        self.outputs = set(g.outputs)
        self.edits: dict[int, list[MNode]] = {}  # id(node) -> the nodes that take its place

    def node(self, value: str, op: str | tuple[str, ...]) -> MNode | None:
        """The producer of ``value`` if it is one of ``op``."""
        n = self.prod.get(value)
        ops = (op,) if isinstance(op, str) else op
        return n if n is not None and n.op in ops else None

    def only_use(self, value: str) -> bool:
        """``value`` is read by exactly one node and is not a graph output."""
        return len(self.uses.get(value, ())) == 1 and value not in self.outputs

    def scalar(self, value: str) -> float | None:
        c = self.g.const(value)
        return scalar_value(c) if c is not None and c.size == 1 else None


def _other(node: MNode, value: str) -> str | None:
    """The other operand of a binary node that has ``value`` as one operand."""
    a, b = node.inputs
    return b if a == value else a if b == value else None


def _replace(v: "_View", old: MNode, op: str, inputs: list[str], attrs: dict, source: str,
             before: tuple[MNode, ...] = ()) -> None:
    """Put the fused node (after ``before``) where ``old`` is, when the sweep ends."""
    v.edits[id(old)] = [*before, MNode(old.name, op, inputs, list(old.outputs), attrs, source)]


REWRITES = ("dense", "silu", "rms_norm", "rope", "silu_mul", "gelu", "batched_transpose", "attention")
#: ops of which a rewrite needs one in the graph to match anything
_TRIGGERS = {"dense": {"linear"}, "silu": {"sigmoid"}, "rms_norm": {"mean"}, "rope": {"neg", "slice_step"},
             "silu_mul": {"silu"}, "gelu": {"erf", "tanh"}, "batched_transpose": {"transpose"},
             "attention": {"softmax"}}


class Canonicalize:
    """The pass: ``run(model) -> CanonicalizeResult`` (rewrites the model in place).

    ``rewrites`` names the rewrites to run (default all of :data:`REWRITES`, in that
    order); the identity bypass always runs.
    """

    name = "canonicalize"

    def __init__(self, rewrites: tuple[str, ...] = REWRITES) -> None:
        unknown = sorted(set(rewrites) - set(REWRITES))
        if unknown:
            raise ValueError(f"unknown rewrites {unknown}; known: {list(REWRITES)}")
        self.rewrites = tuple(r for r in REWRITES if r in rewrites)

    def run(self, g: ModelGraph) -> CanonicalizeResult:
        counts: Counter = Counter()
        _drop_identities(g, counts)
        table = {"dense": _dense, "silu": _silu, "rms_norm": _rms_norm, "rope": _rope, "silu_mul": _silu_mul,
                 "gelu": _gelu, "batched_transpose": _batched_transpose, "attention": _attention}
        for name in self.rewrites:
            if not _TRIGGERS[name] & {node.op for node in g.nodes}:
                continue  # nothing this rewrite could match: skip the sweep (and its view of the graph)
            rewrite = table[name]
            view = _View(g)
            for node in g.nodes:
                if rewrite(g, view, node):
                    counts[rewrite.__name__.lstrip("_")] += 1
            if view.edits:  # one rebuild per sweep: a list.index per rewrite made the pass quadratic
                g.nodes = [new for node in g.nodes for new in view.edits.get(id(node), (node,))]
        g.prune()
        if "attention" in self.rewrites and any(node.op == "softmax" for node in g.nodes):
            _note_biased_attention(g)
        return CanonicalizeResult(dict(counts))


def _drop_identities(g: ModelGraph, counts: Counter) -> None:
    alias: dict[str, str] = {}
    kept = []
    graph_inputs = set(g.inputs)
    for node in g.nodes:
        node.inputs = [alias.get(v, v) for v in node.inputs]
        src = node.inputs[0] if node.inputs else None
        same = node.op == "identity" or (node.op == "cast" and src is not None and
                                         g.values[src].dtype == node.attrs.get("dtype"))
        if same and len(node.outputs) == 1 and not (node.outputs[0] in g.outputs and src in graph_inputs):
            alias[node.outputs[0]] = src
            counts["identity"] += 1
            continue
        kept.append(node)
    g.nodes = kept
    g.outputs = [alias.get(v, v) for v in g.outputs]


# ---------------------------------------------------------------------------- rewrites
def _dense(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "reshape" or not v.only_use(node.inputs[0]):
        return False
    bias: list[str] = []
    lin = v.node(node.inputs[0], "linear")
    add = v.node(node.inputs[0], "add") if lin is None else None
    if add is not None:
        for value in add.inputs:
            lin = v.node(value, "linear")
            b = _other(add, value)
            if lin is not None and v.only_use(value) and len(lin.inputs) == 2 and len(g.shape(b) or ()) == 1:
                bias = [b]
                break
        else:
            return False
    if lin is None or len(lin.inputs) != 2 or not (v.node(lin.inputs[0], "reshape")):
        return False
    x = v.prod[lin.inputs[0]].inputs[0]
    xs, fs, out = g.shape(x), g.shape(lin.inputs[0]), g.shape(node.outputs[0])
    if len(fs) != 2:
        return False
    lead = ()  # the leading dims the flatten merged and the final reshape restores
    for k in range(1, min(len(xs), len(out))):
        if tuple(xs[:k]) == tuple(out[:k]) and int(np.prod(xs[:k])) == fs[0]:
            lead = tuple(xs[:k])
            break
    if not lead or int(np.prod(xs[len(lead):])) != fs[1]:
        return False
    features = g.shape(lin.outputs[0])[1]
    dtype = g.values[x].dtype
    before: list[MNode] = []
    if len(xs) > len(lead) + 1:  # (B, S, N, D) into an (out, N*D) weight: merge the trailing dims first
        merged = g.fresh(f"{node.name}_merged")
        g.add_value(Value(merged, lead + (fs[1],), dtype))
        before.append(MNode(merged, "reshape", [x], [merged], {"shape": list(lead + (fs[1],))}, "fused:dense"))
        x = merged
    if tuple(out) == lead + (features,):  # the fused node is named as the product was (the Dense's cell)
        v.edits[id(node)] = before + [MNode(lin.name, "linear", [x, lin.inputs[1], *bias], list(node.outputs), {},
                                            "fused:dense")]
        return True
    y = g.fresh(f"{node.name}_linear")  # (B, S, out) then split into heads (B, S, N, D) by the reshape
    g.add_value(Value(y, lead + (features,), dtype))
    before.append(MNode(lin.name, "linear", [x, lin.inputs[1], *bias], [y], {}, "fused:dense"))
    _replace(v, node, "reshape", [y], dict(node.attrs), node.source, tuple(before))
    return True


def _silu(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "mul" or len(node.inputs) != 2:
        return False
    for value in node.inputs:
        sig = v.node(value, "sigmoid")
        if sig is not None and _other(node, value) == sig.inputs[0] and node.inputs[0] != node.inputs[1]:
            _replace(v, node, "silu", [sig.inputs[0]], {}, "fused:silu")
            return True
    return False


def _inverse_root(v: _View, node: MNode, x: str) -> str | None:
    """For ``node`` computing ``x * rsqrt(e)`` (or ``x / sqrt(e)``), the value ``e``."""
    if node.op == "div" and node.inputs[0] == x:
        root = v.node(node.inputs[1], "sqrt")
        return root.inputs[0] if root is not None and v.only_use(root.outputs[0]) else None
    if node.op != "mul":
        return None
    r = _other(node, x)
    if r is None or not v.only_use(r):
        return None
    rs = v.node(r, "rsqrt")
    if rs is not None:
        return rs.inputs[0]
    inv = v.node(r, ("reciprocal", "div"))
    if inv is None or (inv.op == "div" and v.scalar(inv.inputs[0]) != 1.0):
        return None
    root = v.node(inv.inputs[-1], "sqrt")
    return root.inputs[0] if root is not None and v.only_use(root.outputs[0]) else None


def _rms_norm(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "mul" or len(node.inputs) != 2:
        return False
    for y in node.inputs:
        w = _other(node, y)
        down = v.node(y, "cast") if v.only_use(y) else None  # HF: normalised in float32, cast back
        if down is not None:
            y = down.inputs[0]
        ynode = v.node(y, ("mul", "div"))
        if ynode is None or not v.only_use(y) or g.const(w) is not None and not g.values[w].weight:
            continue
        for x in ynode.inputs:
            if g.const(x) is not None or not g.shape(x):
                continue
            e = _inverse_root(v, ynode, x)
            if e is None or not v.only_use(e):
                continue
            add = v.node(e, "add")
            if add is None:
                continue
            eps_value = next((a for a in add.inputs if v.scalar(a) is not None), None)
            m = _other(add, eps_value) if eps_value is not None else None
            mean = v.node(m, "mean") if m is not None else None
            if mean is None or not v.only_use(m) or not mean.attrs.get("keepdim"):
                continue
            rank = len(g.shape(x))
            if [d % rank for d in (mean.attrs.get("dims") or [])] != [rank - 1]:
                continue
            sq = v.node(mean.inputs[0], ("pow", "mul"))
            if sq is None or not v.only_use(mean.inputs[0]):
                continue
            if sq.op == "pow" and not (sq.inputs[0] == x and v.scalar(sq.inputs[1]) == 2.0):
                continue
            if sq.op == "mul" and sq.inputs != [x, x]:
                continue
            if g.shape(w) != g.shape(x)[-1:]:
                continue
            source = x
            up = v.node(x, "cast")  # x.to(float32) read by the square and the product only
            if down is not None and up is not None and len(v.uses.get(x, ())) == 2 and x not in v.outputs and \
                    g.values[up.inputs[0]].dtype == g.values[node.outputs[0]].dtype:
                source = up.inputs[0]
            elif down is not None:
                continue
            _replace(v, node, "rms_norm", [source, w], {"eps": v.scalar(eps_value), "normalized_ndim": 1},
                     "fused:rms_norm")
            return True
    return False


def _half_rotation(g: ModelGraph, v: _View, rot: str) -> str | None:
    """The x of ``rot = concat(-x[..., D/2:], x[..., :D/2])``, or None."""
    cat = v.node(rot, "concat")
    if cat is None or len(cat.inputs) != 2 or not v.only_use(rot):
        return None
    neg = v.node(cat.inputs[0], "neg")
    first = v.node(cat.inputs[1], "slice")
    second = v.node(neg.inputs[0], "slice") if neg is not None else None
    if first is None or second is None or first.inputs[0] != second.inputs[0]:
        return None
    x = first.inputs[0]
    shape = g.shape(x)
    d = shape[-1]
    last = len(shape) - 1
    if cat.attrs.get("axis", 0) % len(shape) != last or d % 2:
        return None
    if (first.attrs["axis"] % len(shape), first.attrs["start"], first.attrs["stop"]) != (last, 0, d // 2):
        return None
    if (second.attrs["axis"] % len(shape), second.attrs["start"], second.attrs["stop"]) != (last, d // 2, d):
        return None
    return x


def _interleaved_rotation(g: ModelGraph, v: _View, rot: str) -> str | None:
    """The x of ``rot = reshape(concat(-x[..., 1::2, None], x[..., ::2, None], axis=-1), x.shape)``."""
    reshape = v.node(rot, "reshape")
    if reshape is None or not v.only_use(rot):
        return None
    cat = v.node(reshape.inputs[0], "concat")
    if cat is None or len(cat.inputs) != 2:
        return None
    col0, col1 = (v.node(c, "unsqueeze") for c in cat.inputs)
    if col0 is None or col1 is None:
        return None
    neg = v.node(col0.inputs[0], "neg")
    odd = v.node(neg.inputs[0], "slice_step") if neg is not None else None
    even = v.node(col1.inputs[0], "slice_step")
    if odd is None or even is None or odd.inputs[0] != even.inputs[0]:
        return None
    x = odd.inputs[0]
    shape = g.shape(x)
    rank, d = len(shape), shape[-1]
    if g.shape(rot) != shape or cat.attrs.get("axis") % (rank + 1) != rank or d % 2:
        return None
    if col0.attrs["dims"] != [rank] or col1.attrs["dims"] != [rank]:
        return None
    for piece, start in ((odd, 1), (even, 0)):
        if (piece.attrs["axis"] % rank, piece.attrs["start"], piece.attrs["step"]) != (rank - 1, start, 2) or \
                piece.attrs["stop"] < d - 1:
            return None
    return x


def _rope(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "add" or len(node.inputs) != 2:
        return False
    for p_cos, p_sin in (node.inputs, node.inputs[::-1]):
        m_cos, m_sin = v.node(p_cos, "mul"), v.node(p_sin, "mul")
        if m_cos is None or m_sin is None or not (v.only_use(p_cos) and v.only_use(p_sin)):
            continue
        for rot in m_sin.inputs:
            for mode, finder in ((0, _half_rotation), (1, _interleaved_rotation)):
                x = finder(g, v, rot)
                if x is None or x not in m_cos.inputs:
                    continue
                cos, sin = _other(m_cos, x), _other(m_sin, rot)
                shape = g.shape(x)
                if len(shape) != 4 or g.shape(cos)[-1:] != shape[-1:] or g.shape(sin)[-1:] != shape[-1:]:
                    continue
                _replace(v, node, "rotary_position_embedding", [x, cos, sin], {"mode": mode}, "fused:rope")
                return True
    return False


def _silu_mul(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "mul" or len(node.inputs) != 2:
        return False
    for s in node.inputs:
        silu = v.node(s, "silu")
        if silu is not None and v.only_use(s):
            _replace(v, node, "silu_mul", [silu.inputs[0], _other(node, s)], {}, "fused:silu_mul")
            return True
    return False


def _batched_transpose(g: ModelGraph, v: _View, node: MNode) -> bool:
    """``reshape(transpose(reshape(x, (B*N, S, D)), [0, 2, 1]), (B, N, D, S))`` (torch's export of
    ``k.transpose(-2, -1)`` after grouped-query heads were repeated) ->
    ``transpose(reshape(x, (B, N, S, D)), [0, 1, 3, 2])``."""
    if node.op != "reshape" or not v.only_use(node.inputs[0]):
        return False
    tr = v.node(node.inputs[0], "transpose")
    if tr is None or tr.attrs.get("dims") != [0, 2, 1] or not v.only_use(tr.inputs[0]):
        return False
    flat = v.node(tr.inputs[0], "reshape")
    if flat is None:
        return False
    x = flat.inputs[0]
    xs, fs, out = g.shape(x), g.shape(flat.outputs[0]), g.shape(node.outputs[0])
    if xs is None or fs is None or out is None or len(xs) < 3 or len(fs) != 3 or len(out) < 3:
        return False
    s_, d = fs[1], fs[2]
    if tuple(xs[-2:]) != (s_, d) or tuple(out[-2:]) != (d, s_) or int(np.prod(out[:-2])) != fs[0]:
        return False
    lead = tuple(out[:-2])
    mid = g.fresh(f"{node.name}_heads")
    g.add_value(Value(mid, lead + (s_, d), g.values[x].dtype))
    rank = len(lead) + 2
    before = MNode(mid, "reshape", [x], [mid], {"shape": list(lead + (s_, d))}, "fused:batched_transpose")
    _replace(v, node, "transpose", [mid], {"dims": list(range(rank - 2)) + [rank - 1, rank - 2]},
             "fused:batched_transpose", (before,))
    return True


_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))


def _gelu_erf(g: ModelGraph, v: _View, node: MNode) -> str | None:
    """The x of ``x * 0.5 * (1 + erf(x / sqrt(2)))`` at ``node`` (the last product), in the orders
    torch exports it (``0.5 * x`` first, or ``x * (...)`` then ``* 0.5``); else None."""
    def erf_arg(value: str) -> str | None:  # value = 1 + erf(x / sqrt(2)) -> x
        add = v.node(value, "add")
        if add is None or not v.only_use(value):
            return None
        one = next((a for a in add.inputs if v.scalar(a) == 1.0), None)
        erf = v.node(_other(add, one), "erf") if one is not None else None
        if erf is None or not v.only_use(erf.outputs[0]):
            return None
        x, c = _scaled(g, v, erf.inputs[0])
        return x if abs(c - 1 / np.sqrt(2.0)) < 1e-6 else None

    for value in node.inputs:
        other = _other(node, value)
        x = erf_arg(value)
        if x is not None:
            inner, c = _scaled(g, v, other)  # (0.5 * x) * (1 + erf(...))
            if inner == x and abs(c - 0.5) < 1e-7:
                return x
        half = v.scalar(other)
        prod = v.node(value, "mul") if half is not None and abs(half - 0.5) < 1e-7 and v.only_use(value) else None
        if prod is not None:  # (x * (1 + erf(...))) * 0.5
            for factor in prod.inputs:
                x = erf_arg(factor)
                if x is not None and _other(prod, factor) == x:
                    return x
    return None


def _gelu_tanh(g: ModelGraph, v: _View, node: MNode) -> str | None:
    """The x of ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` at ``node``; else None."""
    def tanh_arg(value: str) -> str | None:
        add = v.node(value, "add")
        if add is None or not v.only_use(value):
            return None
        one = next((a for a in add.inputs if v.scalar(a) == 1.0), None)
        th = v.node(_other(add, one), "tanh") if one is not None else None
        if th is None or not v.only_use(th.outputs[0]):
            return None
        inner, c = _scaled(g, v, th.inputs[0])
        if abs(c - _SQRT_2_OVER_PI) > 1e-6:
            return None
        s = v.node(inner, "add")
        if s is None or not v.only_use(inner):
            return None
        for x in s.inputs:
            cube, k = _scaled(g, v, _other(s, x))
            p = v.node(cube, "pow")
            if p is not None and p.inputs[0] == x and v.scalar(p.inputs[1]) == 3.0 and abs(k - 0.044715) < 1e-7:
                return x
        return None

    for value in node.inputs:
        other = _other(node, value)
        x = tanh_arg(value)
        if x is not None:
            inner, c = _scaled(g, v, other)
            if inner == x and abs(c - 0.5) < 1e-7:
                return x
        half = v.scalar(other)
        prod = v.node(value, "mul") if half is not None and abs(half - 0.5) < 1e-7 and v.only_use(value) else None
        if prod is not None:
            for factor in prod.inputs:
                x = tanh_arg(factor)
                if x is not None and _other(prod, factor) == x:
                    return x
    return None


def _gelu(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "mul" or len(node.inputs) != 2:
        return False
    x = _gelu_erf(g, v, node)
    if x is not None:
        _replace(v, node, "gelu_erf", [x], {}, "fused:gelu")
        return True
    x = _gelu_tanh(g, v, node)
    if x is not None:
        _replace(v, node, "gelu", [x], {}, "fused:gelu")
        return True
    return False


def _note_biased_attention(g: ModelGraph) -> None:
    """A note for each ``softmax(scores + bias) @ v`` left unfused because ``bias`` is neither absent
    nor causal (BERT's padding mask, T5's relative-position bias): the registry's attention takes
    no additive bias, so such attention is imported op for op."""
    v = _View(g)
    for node in g.nodes:
        if node.op != "matmul_nd" or not node.inputs:
            continue
        p = node.inputs[0]
        guarded = _nan_guard(g, v, p)
        soft = v.node(guarded if guarded is not None else p, "softmax")
        shape = g.shape(p)
        if soft is None or shape is None or len(shape) != 4:
            continue
        add = v.node(soft.inputs[0], ("add", "where"))
        if add is not None:
            g.notes.append(f"attention at node {node.name} is left unfused (softmax and products op for op): its "
                           "scores take an additive bias or mask that is not causal (a padding mask, a position "
                           "bias), and scaled_dot_product_attention takes none")


def is_causal_mask(mask: np.ndarray, fill_ok) -> bool:
    """Whether ``mask``'s last two dims hold the top-left causal pattern (the same for every
    leading index): ``fill_ok(value)`` above the diagonal, 0 (or True for a keep-mask) on and below.

    >>> m = np.triu(np.full((3, 3), -np.inf), 1)
    >>> is_causal_mask(m, lambda f: f <= -1e4), is_causal_mask(m.T, lambda f: f <= -1e4)
    (True, False)
    """
    if mask.ndim < 2:
        return False
    rows, cols = mask.shape[-2:]
    flat = mask.reshape((-1, rows, cols))
    above = np.triu(np.ones((rows, cols), dtype=bool), 1)
    for m in flat:
        if not (np.all(m[~above] == 0) and np.all([fill_ok(f) for f in np.unique(m[above])])):
            return False
    return True


def _attention_mask(g: ModelGraph, v: _View, z: str) -> tuple[str, bool] | None:
    """``(scores, causal)`` for ``z`` = scores (+ a causal mask): None when it is another mask."""
    add = v.node(z, "add")
    if add is not None:
        for mask in add.inputs:
            c = g.const(mask)
            if c is not None and c.size > 1 and is_causal_mask(c, lambda f: f <= -1e4):
                return _other(add, mask), True
            if c is not None and not np.any(c) and g.shape(_other(add, mask)) == g.shape(z):
                return _other(add, mask), False  # a padding mask of no padding (BERT fed no attention_mask)
        return None
    where = v.node(z, "where")
    if where is not None:
        cond, a, b = where.inputs
        c = g.const(cond)
        if c is None:
            return None
        keep = c.astype(bool)
        if v.scalar(b) is not None and v.scalar(b) <= -1e4 and is_causal_mask(~keep, lambda f: f):
            return a, True  # where(keep, scores, -inf)
        if v.scalar(a) is not None and v.scalar(a) <= -1e4 and is_causal_mask(keep, lambda f: f):
            return b, True  # where(masked, -inf, scores)
        return None
    return z, False


def _scaled(g: ModelGraph, v: _View, value: str) -> tuple[str, float]:
    """``(x, c)`` when ``value`` is ``x * c`` (or ``scale(x, c)``, ``x / c``) used once, else ``(value, 1)``."""
    node = v.node(value, ("mul", "div", "scale"))
    if node is None or not v.only_use(value):
        return value, 1.0
    if node.op == "scale":
        return node.inputs[0], float(node.attrs["factor"])
    x, c = node.inputs
    if node.op == "mul" and v.scalar(x) is not None:
        x, c = c, x
    if v.scalar(c) is None or g.const(x) is not None or (node.op == "div" and v.scalar(c) == 0):
        return value, 1.0
    return x, (v.scalar(c) if node.op == "mul" else 1.0 / v.scalar(c))


def _nan_guard(g: ModelGraph, v: _View, p: str) -> str | None:
    """For ``p = where(isnan(s), 0, s)`` (torch's guard of a softmax whose row is all masked),
    ``s``; else None."""
    where = v.node(p, "where")
    if where is None or not v.only_use(p):
        return None
    cond, zero, s = where.inputs
    isnan = v.node(cond, "isnan")
    if isnan is None or isnan.inputs[0] != s or v.scalar(zero) != 0.0 or not v.only_use(cond) or \
            len(v.uses.get(s, ())) != 2 or s in v.outputs:
        return None
    return s


def _attention(g: ModelGraph, v: _View, node: MNode) -> bool:
    if node.op != "matmul_nd" or node.attrs.get("transpose_a") or node.attrs.get("transpose_b"):
        return False
    p, val = node.inputs
    guarded = _nan_guard(g, v, p)
    soft = v.node(guarded if guarded is not None else p, "softmax")
    if soft is None or (guarded is None and not v.only_use(p)) or len(g.shape(p)) != 4 or \
            soft.attrs.get("axis", -1) % 4 != 3:
        return False
    found = _attention_mask(g, v, soft.inputs[0])
    if found is None or (found[1] and not v.only_use(soft.inputs[0])):
        return False
    scores, causal = found
    scale = 1.0
    sc = v.node(scores, ("scale", "mul", "div"))
    if sc is not None and v.only_use(scores):
        if sc.op == "scale":
            scale, scores = float(sc.attrs["factor"]), sc.inputs[0]
        else:
            c = next((a for a in sc.inputs[1:] if v.scalar(a) is not None), None) if sc.op == "div" else \
                next((a for a in sc.inputs if v.scalar(a) is not None), None)
            if c is not None:
                scale = 1.0 / v.scalar(c) if sc.op == "div" else v.scalar(c)
                scores = _other(sc, c) if sc.op == "mul" else sc.inputs[0]
    mm = v.node(scores, "matmul_nd")
    if mm is None or not v.only_use(scores) or mm.attrs.get("transpose_a"):
        return False
    q, kt = mm.inputs
    q, q_factor = _scaled(g, v, q)  # torch's SDPA export scales q and k^T by sqrt(scale) each
    kt, k_factor = _scaled(g, v, kt)
    before: tuple[MNode, ...] = ()
    if mm.attrs.get("transpose_b"):
        k = kt
    else:
        tr = v.node(kt, "transpose")
        if tr is None or tr.attrs.get("dims") not in ([0, 1, 3, 2], [0, 2, 3, 1]):
            return False
        if tr.attrs["dims"] == [0, 1, 3, 2]:
            k, factor = _scaled(g, v, tr.inputs[0]) if v.only_use(kt) else (tr.inputs[0], 1.0)
            k_factor *= factor
        else:  # k^T straight from (B, S, N, D), as the TorchScript exporter writes BERT's: k is its BNSD transpose
            src = tr.inputs[0]
            b_, s_, n_, d_ = g.shape(src)
            k = g.fresh(f"{node.name}_key")
            g.add_value(Value(k, (b_, n_, s_, d_), g.values[src].dtype))
            before = (MNode(k, "transpose", [src], [k], {"dims": [0, 2, 1, 3]}, "fused:attention"),)
    scale *= q_factor * k_factor
    qs, ks, vs = g.shape(q), g.shape(k), g.shape(val)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or qs[:2] != ks[:2] or ks[:3] != vs[:3] or qs[3] != ks[3]:
        return False
    if causal and qs[2] != ks[2]:
        return False
    _replace(v, node, "scaled_dot_product_attention", [q, k, val],
             {"layout": "BNSD", "causal": causal, "scale": scale}, "fused:attention", before)
    return True
