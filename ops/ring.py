"""Ring attention: the ops ``scaled_dot_product_attention`` with ``context_parallel='ring'`` expands into.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron's
context parallelism; torch's ``_templated_ring_attention``) keeps q, k and v sharded on the
sequence along one mesh axis of n ranks and runs n steps: each rank attends its query block
to the key/value block it holds, passes k and v on to the next rank of the ring (a
point-to-point ``permute``) and merges the partial results by their log-sum-exp (the online
softmax).  It moves the bytes of an all-gather of k and v ((n - 1) blocks of each per rank)
but no rank ever holds more than one block of them.

The expand pass (``check --reshard``, ``run``, ``lower``, ``estimate``) writes a
``scaled_dot_product_attention`` node whose ``context_parallel`` is ``ring`` as
``NODE/block0``, then for j = 1 .. n-1 ``NODE/k_shift{j}``, ``NODE/v_shift{j}``,
``NODE/block{j}``, ``NODE/merge{j}``, and the node itself as a ``slice`` of the merged
result (its output, without the log-sum-exp column).  The backward is the gradient of these
ops (each has its vjp).  ``flash_attention_score`` with ``context_parallel='ring'`` is
written alike on q, k, v brought to BSND (BSH: ``NODE/q_heads``... reshapes to heads; SBH:
then ``NODE/q_bsnd``... transposes) and the result brought back (``NODE/out_heads``, then a
reshape as the node), for ``sparse_mode`` 0 without a band, 2 and 3, without attn_mask and
dropout (:func:`flash_ring_attention`).

The ops
-------
``ring_shift(x, dim, blocks, shift=1)``
    ``x`` cut into ``blocks`` equal blocks along ``dim``; output block i is input block
    ``(i - shift) mod blocks`` (``np.roll`` by ``shift`` blocks).  Linear (a Partial input
    passes through).  Layout rule: when ``dim`` is sharded on exactly one mesh axis of
    ``blocks`` ranks (and on no other axis of more than one rank), the op IS communication:
    lowering writes it as a cyclic ``permute`` on that axis (each rank sends its block to
    the rank ``shift`` coordinates on), ``check`` lists that step among the moves and the
    step model prices it as a collective; when ``dim`` is not sharded it is a local roll.
    Any other sharding of ``dim`` is ``sharding-mismatch`` (fix: all-gather the dim).  The
    output has the input's layout.  Gradient: ``ring_shift`` by ``-shift``.
``attention_block(q, k, v, blocks, step=0, layout="BNSD", causal=False, scale=None, q_offset=0, zigzag=0)``
    One step of the ring.  q's sequence and k's (and v's) are cut into ``blocks`` equal
    blocks; query block i attends only to block i of the k and v given, which ``ring_shift``
    has rolled ``step`` times: it holds the ORIGINAL key/value block ``(i - step) mod
    blocks``, and the causal mask (top-left, ``j <= i + q_offset`` as for
    ``scaled_dot_product_attention``) compares original positions; with ``zigzag=P`` the
    sequence is stored in the zig-zag order of 2P chunks (as for
    ``scaled_dot_product_attention``: the load-balanced ring) and the mask compares
    positions in the sequence.  The output packs the
    block's attention output and its log-sum-exp: shape q's with the last dim ``Dv + 1``,
    ``out[..., :Dv]`` the softmax over the visible keys of the block times v (zeros where a
    row sees no key) and ``out[..., Dv]`` ``log(sum(exp(scale * q.k)))`` over those keys
    (``-inf`` where none).  Grouped-query heads as ``scaled_dot_product_attention``.
    Layout rule: q drives; its batch and head dims shard freely, its sequence dim too when
    every rank then holds whole blocks (the number of sequence shards divides ``blocks``;
    else ``sharding-mismatch``, fixed by an all-gather); D is whole (``sharded-head-dim``);
    nothing is Partial (``partial-input``).  k and v shard B, the heads and the sequence as
    q does (``sharding-mismatch`` otherwise; a Replicate k is sliced for free): a rank then
    holds the key blocks its query blocks attend to, so the op runs on every rank without
    communication.  Localised: ``q_start``, ``kv_start`` (the global index of the rank's
    first query and key row), ``q_total``, ``kv_total`` and ``kv_head_map``.
``attention_merge(a, b)``
    The log-sum-exp combine of two packed partial results (online softmax): with
    ``L = logaddexp(la, lb)``, the output is ``exp(la - L) * oa + exp(lb - L) * ob``, packed
    with ``L``.  Elementwise but for the last dim, which must be whole
    (``sharded-head-dim``); a and b of equal shapes (``invalid-shape``), b like a
    (``sharding-mismatch``), neither Partial (``partial-input``).
Grad ops (``differentiable = False``)
    ``attention_block_grad(dy, q, k, v) -> (dq, dk, dv)`` (recomputes the block's
    probabilities; dy's last column is the cotangent of the log-sum-exp): dq like q, dk and
    dv like k and v (each rank owns the key blocks only its own query blocks read: no
    Partial on the sequence axes; ``P(sum)`` on the axes that shard q's heads but not the
    replicated kv heads).  ``attention_merge_grad(dy, a, b) -> (da, db)``.

Memory: in the forward a rank holds a pair of k, v blocks and the next pair arriving, never
k and v whole (measured on q, k, v (1, 8, 4096, 64) float16 on cp=4: activation peak
5,292,032 bytes per rank against the gather's 9,437,184).  With the backward, the expanded
graph keeps every step's shifted k and v block for the gradient (a backward that passes k
and v around the ring again, as ring implementations do, is not written), so the saving
shrinks (16,924,672 against 19,922,944 bytes).

The zig-zag order (``zigzag=P`` on the attention) passes to the blocks: the load-balanced
ring is computed correctly, but the balance itself is not visible here, since no block
skips work.  Not done: a ring over several mesh axes (a sequence sharded on sp and tp, as
``gen llama`` propagates it on larger shapes, gathers k and v with a note: shifting a block
across the flattened axes is not one permute), an overlap model of the permutes with the
blocks' compute (the step model adds them, all exposed), skipping the causal blocks that lie wholly in the future
(they run and contribute nothing; the step model counts every block's FLOPs), and ring
attention for ``flash_attention_score``'s band (mode 4, pre/next tokens), attn_mask,
dropout and TND layouts (those gather key and value).

Violation codes
---------------
- ``partial-input``: q, k, v or a merge operand is Partial (not linear in it).
- ``sharded-head-dim``: D, or the packed last dim, is sharded.
- ``sharding-mismatch``: k or v not sharded like q; a sequence sharding that does not hold
  whole blocks; ring_shift's dim sharded other than on one axis of ``blocks`` ranks;
  b unlike a; dy unlike the output.
- ``broadcast-shape``: a cotangent of the wrong shape.
- ``invalid-shape``: shapes the op cannot take (q, k, v that do not agree, a sequence or
  dim that is not a multiple of ``blocks``, a zig-zag order the sequences cannot take,
  merge operands of different shapes).
- ``invalid-attr``: an attr value the op cannot take (blocks, step, shift, dim, causal...).
- ``invalid-input-layout``: an attention ``layout`` other than ``"BNSD"`` and ``"BSND"``.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((4,), ("cp",))
>>> k = TensorSpec((1, 2, 8, 4), "float32", Layout(mesh, ["S(2)"], 4))
>>> rule = get_rule("ring_shift")
>>> attrs = rule.normalize_attrs({"dim": 2, "blocks": 4})
>>> res = rule.infer_layout((k,), attrs)
>>> str(res.outputs[0].layout), res.violations
('(S(2))', ())
>>> [s.to_dict() for s in rule.comm_steps(attrs, (k,), res.outputs)]
[{'kind': 'permute', 'mesh_axis': 'cp', 'shift': 1, 'cyclic': True, 'bytes_per_rank': 64}]
"""

from __future__ import annotations

import math
import numbers
from functools import lru_cache

from layout_prop.core.errors import Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard
from layout_prop.core.redistribute import permute_step
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec

from .common import move_violations as _move_violations
from .nn import (ATTENTION_CODES, ATTENTION_LAYOUTS, _attention_attr_violations, _attention_shape_violations,
                 _cotangent, _is_float, _kv_want, _name, _partial_issue, _want, _whole_dims, _with_partials,
                 float_dtype, kv_head_map, zigzag_problems)

__all__ = ["RingShift", "AttentionBlock", "AttentionBlockGrad", "AttentionMerge", "AttentionMergeGrad",
           "ring_attention", "get_rule"]

RING_CODES = ("sharding-mismatch", "invalid-shape", "invalid-attr")  # linear: a Partial x passes through
MERGE_CODES = ("partial-input", "sharded-head-dim", "sharding-mismatch", "broadcast-shape", "invalid-shape")
# a block's k and v are sharded like q (sharding-mismatch otherwise), never gathered: no sharded-kv-sequence;
# broadcast-shape is the grad's cotangent of the wrong shape
BLOCK_CODES = tuple(c for c in ATTENTION_CODES if c not in ("sharded-kv-sequence", "broadcast-shape"))
BLOCK_GRAD_CODES = tuple(c for c in ATTENTION_CODES if c != "sharded-kv-sequence")
_BLOCK_ATTRS = {"blocks": None, "step": 0, "layout": "BNSD", "causal": False, "scale": None, "q_offset": 0,
                "zigzag": 0}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bad(message: str, hint: str, operand: str) -> Violation:
    return Violation("invalid-attr", message, hint, operand=operand)


# ---------------------------------------------------------------------------------------- ring_shift
def _ring_axis(x: TensorSpec, dim: int, blocks: int) -> tuple[int | None, bool]:
    """``(axis, ok)``: the one mesh axis (of ``blocks`` ranks) a ring shift of ``dim`` permutes on
    (None: a local roll), and whether ``x``'s sharding of ``dim`` allows the shift at all."""
    axes = [a for a in x.layout.dim_axes(dim) if x.mesh.shape[a] > 1]
    if not axes:
        return None, True
    return axes[0], len(axes) == 1 and x.mesh.shape[axes[0]] == blocks


def _ring_attr_violations(x: TensorSpec, attrs: dict) -> list[Violation]:
    dim, blocks, shift = attrs["dim"], attrs["blocks"], attrs["shift"]
    if not _is_int(dim) or not -x.ndim <= dim < max(x.ndim, 1) or x.ndim == 0:
        return [_bad(f"dim={dim!r} is not a dim of x (rank {x.ndim})", f"give dim in 0..{max(x.ndim - 1, 0)}", "x")]
    if not _is_int(blocks) or blocks < 1:
        return [_bad(f"blocks={blocks!r} is not a positive integer", "give blocks, the ring's length", "x")]
    if not _is_int(shift):
        return [_bad(f"shift={shift!r} is not an integer", "give shift, the blocks moved (1: one step on)", "x")]
    size = x.shape[dim]
    if size % blocks:
        return [Violation("invalid-shape", f"x's dim {dim % x.ndim} has size {size}, not a multiple of "
                          f"blocks={blocks} (x {list(x.shape)})", "give blocks dividing the dim", operand="x")]
    return []


@lru_cache(maxsize=256)
def _ring_permute(x: TensorSpec, axis: int, shift: int):
    """The cyclic permute of ``x`` on ``axis``: one per spec, however many shifts of a ring (and passes:
    expand, check, lower, memory, estimate) ask it; ``permute_step`` checks every rank's piece."""
    return permute_step(x, axis, shift, cyclic=True, dst=x)


@register_op
class RingShift(OpRule):
    """``ring_shift(x, dim, blocks, shift=1)``: roll ``x`` by ``shift`` of ``blocks`` blocks along ``dim``."""

    name = "ring_shift"
    operands = ("x",)
    attr_defaults = {"dim": None, "blocks": None, "shift": 1}
    attr_types = {"dim": "int", "blocks": "int", "shift": "int"}
    required_attrs = ("dim", "blocks")
    violation_codes = RING_CODES

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        violations = _ring_attr_violations(x, attrs)
        if violations:
            return RuleResult((None,), tuple(violations), ())
        dim, blocks = attrs["dim"] % x.ndim, attrs["blocks"]
        if attrs["shift"] % blocks == 0:  # moves nothing: any layout
            return RuleResult((x,), (), ())
        axis, ok = _ring_axis(x, dim, blocks)
        if ok:
            return RuleResult((x,), (), ())
        want = x.layout.with_placements([Replicate() if isinstance(p, Shard) and p.dim == dim else p
                                         for p in x.layout.placements])
        axes = [a for a in x.layout.dim_axes(dim) if x.mesh.shape[a] > 1]
        names = ", ".join(_name(x.mesh, a) for a in axes)
        issue = ("sharding-mismatch", f"x's dim {dim} (size {x.shape[dim]}) is sharded on mesh axis {names} (x is "
                 f"{x.layout}); a ring shift of {blocks} blocks moves whole blocks between the ranks of one mesh "
                 f"axis of {blocks} ranks", f"shard dim {dim} on one mesh axis of {blocks} ranks, or all-gather x on "
                 f"{names}")
        out = TensorSpec(x.shape, x.dtype, want)
        return RuleResult((out,), tuple(_move_violations(x, want, "x", [issue])), (_want(want, x),))

    def comm_steps(self, attrs, inputs, outputs):
        # the shift reads x as its rule asks it, which is the output's layout (a strided shard of x,
        # say, gathered first by apply_rule): the raw input spec may hold pieces of another shape
        x = outputs[0] if outputs and outputs[0] is not None else inputs[0]
        dim, blocks, shift = attrs["dim"] % x.ndim, attrs["blocks"], attrs["shift"]
        if shift % blocks == 0:
            return ()
        axis, ok = _ring_axis(x, dim, blocks)
        if axis is None or not ok:
            return ()
        return (_ring_permute(x, axis, shift),)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[0]:
            return (None,)
        return (g.op(self.name, [dy], {**attrs, "shift": -attrs["shift"]}),)


# ---------------------------------------------------------------------------------- attention_block
def _block_attr_violations(attrs: dict) -> list[Violation]:
    out = _attention_attr_violations({**attrs, "context_parallel": "all_gather"})
    blocks, step = attrs["blocks"], attrs["step"]
    if not _is_int(blocks) or blocks < 1:
        out.append(_bad(f"blocks={blocks!r} is not a positive integer", "give blocks, the ring's length", "q"))
    elif not _is_int(step) or not 0 <= step < blocks:
        out.append(_bad(f"step={step!r} is not an integer in [0, {blocks})", "give step, the ring step "
                        "(how many times k and v were shifted)", "q"))
    return out


def _seq_shards(spec: TensorSpec, layout: Layout, s: int) -> int:
    return math.prod(spec.mesh.shape[a] for a in layout.dim_axes(s))


def _block_analysis(q: TensorSpec, k: TensorSpec, v: TensorSpec, attrs: dict):
    """``(q_fixed, kv_wants, wants, violations, dims)`` of attention_block (q_fixed None: unusable)."""
    violations = _block_attr_violations(attrs)
    dims = ATTENTION_LAYOUTS.get(attrs["layout"])
    if dims is not None:
        violations += _attention_shape_violations(q, k, v, dims)
    if not violations:
        s, blocks = dims["S"], attrs["blocks"]
        for name, t in (("q", q), ("k", k)):
            if t.shape[s] % blocks:
                violations.append(Violation("invalid-shape", f"{name}'s sequence (dim {s}) is {t.shape[s]}, not a "
                                            f"multiple of blocks={blocks}", "give blocks dividing the query and key "
                                            "sequences", operand=name))
        if not violations and q.shape[dims["D"]] == 0 and attrs["scale"] is None:
            violations.append(Violation("invalid-shape", f"q's head dim D is 0 (q {list(q.shape)}): the default "
                                        "scale 1/sqrt(D) is undefined", "give an explicit scale", operand="q"))
        if not violations and attrs["zigzag"]:
            violations += zigzag_problems(q.shape[s], k.shape[s], attrs["zigzag"], "q")
    if violations:
        return None, (None, None), [None, None, None], violations, dims
    s = dims["S"]
    q_fixed, issues = _whole_dims(q, "q", [dims["D"]], "sharded-head-dim", "attention_block",
                                  "attention contracts over whole heads", ", or shard B, N or S of q instead")
    if attrs["blocks"] % _seq_shards(q, q_fixed, s):
        axes = q_fixed.dim_axes(s)
        names = ", ".join(_name(q.mesh, a) for a in axes)
        issues.append(("sharding-mismatch", f"q's sequence (dim {s}, size {q.shape[s]}) is cut into "
                       f"{_seq_shards(q, q_fixed, s)} shards on mesh axis {names} (q is {q.layout}), which do not "
                       f"hold whole blocks of the {attrs['blocks']}", f"all-gather q on {names}, or shard the "
                       f"sequence on a number of ranks dividing {attrs['blocks']}"))
        q_fixed = q_fixed.with_placements([Replicate() if a in axes else p for a, p in enumerate(q_fixed.placements)])
    violations = _move_violations(q, q_fixed, "q", issues)
    wants: list[Layout | None] = [_want(q_fixed, q)]
    kv_wants = []
    seq_axes = q_fixed.dim_axes(s)
    for name, t in (("k", k), ("v", v)):
        want = _kv_want(q, q_fixed, t, dims)
        want = want.with_placements([Shard(s) if a in seq_axes else p for a, p in enumerate(want.placements)])
        violations += _move_violations(t, want, name, _kv_issues(name, t, want, q_fixed, dims))
        wants.append(_want(want, t))
        kv_wants.append(want)
    return q_fixed, tuple(kv_wants), wants, violations, dims


def _kv_issues(name: str, t: TensorSpec, want: Layout, q_fixed: Layout, dims: dict) -> list:
    issues = []
    for axis, (p, w) in enumerate(zip(t.layout.placements, want.placements)):
        if p == w:
            continue
        axis_name = _name(t.mesh, axis)
        if isinstance(p, Partial):
            issues.append(_partial_issue(t, name, axis, "attention_block", "is not linear in it, so every rank "
                                         "needs whole values"))
        elif isinstance(p, Shard) and p.dim == dims["D"]:
            issues.append(("sharded-head-dim", f"{name}'s head dim {p.dim} is sharded on mesh axis {axis_name} "
                           f"({name} is {t.layout}); attention contracts over whole heads",
                           f"all-gather {name} on {axis_name}"))
        else:
            issues.append(("sharding-mismatch", f"{name} is {p} on mesh axis {axis_name} but {w} there holds the "
                           f"key blocks of the query blocks q holds (q is {q_fixed}, {name} is {t.layout})",
                           f"give {name} the layout {want}"))
    return issues


def _packed_shape(q: TensorSpec, v: TensorSpec) -> tuple[int, ...]:
    return tuple(q.shape[:-1]) + (v.shape[-1] + 1,)


def _block_localized(attrs: dict, q: TensorSpec, k: TensorSpec, rank: int) -> dict:
    dims = ATTENTION_LAYOUTS[attrs["layout"]]
    s, n = dims["S"], dims["N"]
    q_slices, k_slices = q.local_slices(rank), k.local_slices(rank)
    out = {**attrs, "q_start": q_slices[s][0], "kv_start": k_slices[s][0], "q_total": q.shape[s],
           "kv_total": k.shape[s]}
    if q.shape[n] != k.shape[n]:
        out["kv_head_map"] = kv_head_map(q_slices[n], k_slices[n], q.shape[n] // k.shape[n])
    return out


@register_op
class AttentionBlock(OpRule):
    """``attention_block(q, k, v, blocks, step=0, ...)``: one ring step, packed output and log-sum-exp."""

    name = "attention_block"
    operands = ("q", "k", "v")
    attr_defaults = dict(_BLOCK_ATTRS)
    attr_types = {"blocks": "int", "step": "int"}
    required_attrs = ("blocks",)
    violation_codes = BLOCK_CODES

    def infer_layout(self, inputs, attrs):
        q, k, v = inputs
        q_fixed, _, wants, violations, _ = _block_analysis(q, k, v, attrs)
        out = None
        if q_fixed is not None:
            out = TensorSpec(_packed_shape(q, v), float_dtype(q.dtype, k.dtype, v.dtype), q_fixed)
        return RuleResult((out,), tuple(violations), tuple(wants))

    def localize(self, attrs, inputs, outputs, rank):
        return _block_localized(attrs, inputs[0], inputs[1], rank)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None, None)
        grads = g.op("attention_block_grad", [dy, *inputs], dict(attrs), num_outputs=3)
        return tuple(gv if need and _is_float(g.spec(i).dtype) else None for gv, need, i in zip(grads, needs, inputs))


@register_op
class AttentionBlockGrad(OpRule):
    """``attention_block_grad(dy, q, k, v) -> (dq, dk, dv)``: dq like q, dk and dv like k and v."""

    name = "attention_block_grad"
    operands = ("dy", "q", "k", "v")
    num_outputs = 3
    attr_defaults = dict(_BLOCK_ATTRS)
    attr_types = {"blocks": "int", "step": "int"}
    required_attrs = ("blocks",)
    violation_codes = BLOCK_GRAD_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, q, k, v = inputs
        q_fixed, kv_wants, wants, violations, dims = _block_analysis(q, k, v, attrs)
        if q_fixed is None:
            return RuleResult((None,) * 3, tuple(violations), ())
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, q_fixed, _packed_shape(q, v), self.name)
        violations = dy_violations + violations
        if not dy_ok:
            return RuleResult((None,) * 3, tuple(violations), ())
        grads = [TensorSpec(q.shape, q.dtype, _with_partials(q_fixed, partials))]
        for t, want in zip((k, v), kv_wants):
            summed = set(q_fixed.dim_axes(dims["N"])) - set(want.dim_axes(dims["N"]))  # replicated kv heads
            ps = [partials.get(a, Partial("sum") if a in summed else p) for a, p in enumerate(want.placements)]
            grads.append(TensorSpec(t.shape, t.dtype, Layout(t.mesh, ps, t.ndim)))
        return RuleResult(tuple(grads), tuple(violations), (_want(dy_want, dy), *wants))

    def localize(self, attrs, inputs, outputs, rank):
        return _block_localized(attrs, inputs[1], inputs[2], rank)


# ---------------------------------------------------------------------------------- attention_merge
def _merge_analysis(a: TensorSpec, b: TensorSpec, op: str):
    """``(a_fixed, wants, violations)``; a_fixed None when the shapes are unusable."""
    if a.ndim == 0 or tuple(a.shape) != tuple(b.shape) or a.shape[-1] < 1:
        return None, [None, None], [Violation("invalid-shape", f"a has shape {list(a.shape)} and b {list(b.shape)}: "
                                              f"{op} combines two packed results of one shape (the last dim the "
                                              "output and the log-sum-exp)", "give a and b the same shape",
                                              operand="b")]
    last = a.ndim - 1
    a_fixed, issues = _whole_dims(a, "a", [last], "sharded-head-dim", op, "the last dim packs the output and its "
                                  "log-sum-exp, which the merge reads together", ", or shard the other dims")
    violations = _move_violations(a, a_fixed, "a", issues)
    b_issues = []
    for axis, (p, w) in enumerate(zip(b.layout.placements, a_fixed.placements)):
        if p == w:
            continue
        if isinstance(p, Partial):
            b_issues.append(_partial_issue(b, "b", axis, op, "is not linear in it"))
        else:
            b_issues.append(("sharding-mismatch", f"b is {p} on mesh axis {_name(b.mesh, axis)} but a is {w} there "
                             f"(a is {a.layout}, b is {b.layout}); the merge is elementwise",
                             f"give b a's layout {a_fixed}"))
    violations += _move_violations(b, a_fixed, "b", b_issues)
    return a_fixed, [_want(a_fixed, a), _want(a_fixed, b)], violations


@register_op
class AttentionMerge(OpRule):
    """``attention_merge(a, b)``: the log-sum-exp combine of two packed partial attention results."""

    name = "attention_merge"
    operands = ("a", "b")
    violation_codes = MERGE_CODES

    def infer_layout(self, inputs, attrs):
        a, b = inputs
        a_fixed, wants, violations = _merge_analysis(a, b, self.name)
        out = None if a_fixed is None else TensorSpec(a.shape, float_dtype(a.dtype, b.dtype), a_fixed)
        return RuleResult((out,), tuple(violations), tuple(wants))

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None)
        grads = g.op("attention_merge_grad", [dy, *inputs], {}, num_outputs=2)
        return tuple(gv if need and _is_float(g.spec(i).dtype) else None for gv, need, i in zip(grads, needs, inputs))


@register_op
class AttentionMergeGrad(OpRule):
    """``attention_merge_grad(dy, a, b) -> (da, db)``, like a and b."""

    name = "attention_merge_grad"
    operands = ("dy", "a", "b")
    num_outputs = 2
    violation_codes = MERGE_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, a, b = inputs
        a_fixed, wants, violations = _merge_analysis(a, b, "attention_merge")
        if a_fixed is None:
            return RuleResult((None, None), tuple(violations), ())
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, a_fixed, a.shape, "attention_merge")
        violations = dy_violations + violations
        if not dy_ok:
            return RuleResult((None, None), tuple(violations), ())
        grads = tuple(TensorSpec(t.shape, t.dtype, _with_partials(a_fixed, partials)) for t in (a, b))
        return RuleResult(grads, tuple(violations), (_want(dy_want, dy), *wants))


# ------------------------------------------------------------------------------ the expansion
def ring_attention(b, inputs, attrs: dict, specs) -> str | None:
    """The expand hook of ``scaled_dot_product_attention`` with ``context_parallel='ring'``.

    None (with a note) where the ring does not apply: the node then gathers k and v as under
    ``all_gather``.
    """
    if attrs.get("context_parallel") != "ring":
        return None
    q, k, v = specs
    dims = ATTENTION_LAYOUTS.get(attrs["layout"])
    if dims is None:
        return None
    s = dims["S"]
    node = b.node.name

    def keep(why: str) -> None:
        b.note(f"expand: {node} (scaled_dot_product_attention, context_parallel='ring') gathers k and v instead: "
               f"{why}")

    n = _ring_ranks(b, specs, s, ("q", "k", "v"), keep)
    if n is None:
        return None
    common = {"layout": attrs["layout"], "causal": attrs["causal"], "scale": attrs["scale"],
              "q_offset": attrs["q_offset"], "zigzag": attrs["zigzag"], "blocks": n}
    acc = _ring_steps(b, inputs[:3], common, s)
    return b.result("slice", [acc], {"axis": q.ndim - 1, "start": 0, "stop": v.shape[-1]})


def _ring_ranks(b, specs, s: int, names: tuple, keep) -> int | None:
    """The ranks of the one mesh axis q, k and v's sequence (dim ``s``) are sharded on alone, after
    ``b.force`` (None, after ``keep(why)``, where the ring does not apply).  ``names``: how the
    note calls q, k and v."""
    q, k, v = specs
    q_axes = [a for a in q.layout.dim_axes(s) if q.mesh.shape[a] > 1]
    if not q_axes and any(q.mesh.shape[a] > 1 for a in q.layout.cut_axes(s)):
        keep(f"{names[0]}'s sequence (dim {s}) is cut by strided shards only ({names[0]} is {q.layout}); the ring "
             "runs on a plain shard of it on one mesh axis")
        return None
    if len(q_axes) != 1:
        keep(f"{names[0]}'s sequence (dim {s}) is sharded on {len(q_axes)} mesh axes ({names[0]} is {q.layout}); "
             "the ring runs on one")
        return None
    axis = q_axes[0]
    n = q.mesh.shape[axis]
    for name, t in zip(names[1:], (k, v)):
        if [a for a in t.layout.dim_axes(s) if t.mesh.shape[a] > 1] != [axis]:
            keep(f"{name}'s sequence is not sharded on mesh axis {q.mesh.names[axis]!r} alone like {names[0]}'s "
                 f"({name} is {t.layout}, {names[0]} {q.layout})")
            return None
    if q.shape[s] % n or k.shape[s] % n:
        keep(f"the query ({q.shape[s]}) and key ({k.shape[s]}) sequences are not multiples of the {n} ranks of "
             f"{q.mesh.names[axis]!r}")
        return None
    b.force(f"context_parallel='ring' on mesh axis {q.mesh.names[axis]!r}")
    return n


def _ring_steps(b, qkv, common: dict, seq: int) -> str:
    """The ring on values q, k, v (sequence dim ``seq``): ``common["blocks"]`` attention_block steps,
    k and v shifted on between them, merged as they come; the packed result's name."""
    n = common["blocks"]
    shift = {"dim": seq, "blocks": n, "shift": 1}
    q, kj, vj = qkv
    acc = None
    for j in range(n):
        if j:
            kj = b.op("ring_shift", [kj], shift, name=f"k_shift{j}")
            vj = b.op("ring_shift", [vj], shift, name=f"v_shift{j}")
        part = b.op("attention_block", [q, kj, vj], {**common, "step": j}, name=f"block{j}")
        acc = part if acc is None else b.op("attention_merge", [acc, part], name=f"merge{j}")
    return acc


#: flash_attention_score's layouts the ring takes, and the attention_block layout each is brought to
_FA_RING_LAYOUTS = {"BNSD": "BNSD", "BSND": "BSND", "BSH": "BSND", "SBH": "BSND"}
_INT32_MAX = 2 ** 31 - 1


def flash_ring_attention(b, inputs, attrs: dict, specs) -> str | None:
    """The expand hook of ``flash_attention_score`` with ``context_parallel='ring'``: the ring of
    :func:`ring_attention` on q, k, v brought to BSND (BSH: a reshape to heads; SBH: a reshape and
    a transpose) or kept in BNSD / BSND, then brought back.

    Takes sparse modes 0 (no band: the default pre/next tokens), 2 (top-left causal) and 3
    (bottom-right causal, keys at least as many as queries), without attn_mask and dropout; None
    (with a note: the node gathers k and v) elsewhere.
    """
    if attrs.get("context_parallel") != "ring":
        return None
    node = b.node.name

    def keep(why: str) -> None:
        b.note(f"expand: {node} (flash_attention_score, context_parallel='ring') gathers key and value instead: "
               f"{why}")

    layout, mode = attrs["input_layout"], attrs["sparse_mode"]
    if layout not in _FA_RING_LAYOUTS:
        keep(f"input_layout {layout} (the ring takes BSH, SBH, BNSD, BSND)")
        return None
    if len(inputs) > 3:
        keep("an attn_mask is given (the ring takes sparse modes 0, 2, 3 without a mask)")
        return None
    if attrs["keep_prob"] != 1:
        keep(f"keep_prob={attrs['keep_prob']} (the ring's blocks draw no dropout)")
        return None
    banded = attrs["pre_tokens"] != _INT32_MAX or attrs["next_tokens"] != _INT32_MAX
    if mode not in (0, 2, 3) or (mode == 0 and banded):
        keep(f"sparse_mode={mode}" + (" with a band (pre_tokens/next_tokens)" if mode == 0 else "") +
             " (the ring takes modes 0 without a band, 2 and 3)")
        return None
    q, k, v = specs
    s_dim = 0 if layout == "SBH" else 1 if layout in ("BSH", "BSND") else 2
    sq, skv = q.shape[s_dim], k.shape[s_dim]
    offset = skv - sq if mode == 3 else 0
    if offset < 0:
        keep(f"sparse_mode 3 with fewer keys ({skv}) than queries ({sq})")
        return None
    n = _ring_ranks(b, specs, s_dim, ("query", "key", "value"), keep)
    if n is None:
        return None
    heads = attrs["head_num"]
    names = list(inputs[:3])
    if layout in ("BSH", "SBH"):  # H = N * D: to (., ., N, D), and SBH to BSND
        d = q.shape[-1] // heads
        for i, (name, t) in enumerate(zip(("q", "k", "v"), (q, k, v))):
            split = b.op("reshape", [names[i]], {"shape": list(t.shape[:2]) + [t.shape[2] // d, d]},
                         name=f"{name}_heads")
            names[i] = split if layout == "BSH" else b.op("transpose", [split], {"dims": [1, 0, 2, 3]},
                                                           name=f"{name}_bsnd")
    block_layout = _FA_RING_LAYOUTS[layout]
    seq = 2 if block_layout == "BNSD" else 1
    common = {"layout": block_layout, "causal": mode in (2, 3), "scale": attrs["scale"], "q_offset": offset,
              "zigzag": attrs["zigzag"], "blocks": n}
    acc = _ring_steps(b, names, common, seq)
    packed = b.spec(acc)
    if layout in ("BNSD", "BSND"):
        return b.result("slice", [acc], {"axis": 3, "start": 0, "stop": packed.shape[3] - 1})
    out = b.op("slice", [acc], {"axis": 3, "start": 0, "stop": packed.shape[3] - 1}, name="out_heads")
    if layout == "SBH":
        out = b.op("transpose", [out], {"dims": [1, 0, 2, 3]}, name="out_sbnd")
    return b.result("reshape", [out], {"shape": list(q.shape)})
