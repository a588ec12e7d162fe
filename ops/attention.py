"""Rules of the attention op family: ``flash_attention_score``, MindSpore's fused attention.

The op
------
``flash_attention_score(query, key, value, head_num, input_layout="BSH", scale=1.0, keep_prob=1.0,
sparse_mode=0, pre_tokens=2147483647, next_tokens=2147483647, actual_seq_qlen=None, actual_seq_kvlen=None,
context_parallel="all_gather", seed=0, zigzag=0)``
    MindSpore's ``ops.flash_attention_score`` (the CANN kernel FlashAttentionScore, torch_npu's
    ``npu_fusion_attention``): ``softmax(mask(scale * q k^T)) v`` per batch and head.  Aliases
    ``FlashAttentionScore``, ``npu_fusion_attention``.  One output, the
    attention (MindSpore's output 3; its softmax statistics are kernel internals).

    ``input_layout``: ``BSH`` (q ``(B, S1, H1)``, ``H1 = N1 * D``), ``SBH``, ``BNSD``, ``BSND`` or
    ``TND`` (packed variable-length sequences, q ``(T1, N1, D)``).  ``head_num`` is N1, q's
    head count.  k and v have the same shape, with ``N2`` heads: N2 divides N1 (grouped-query
    attention: query head h uses kv head ``h // (N1 / N2)``).  ``scale`` is MindSpore's
    ``scalar_value`` (default 1.0, not ``1/sqrt(D)``).

    The mask, by ``sparse_mode``, for query row i and key j (of one sequence of ``Sq``
    queries and ``Skv`` keys); a row that sees no key gives zeros:

    - 0: the band ``i - pre_tokens <= j <= i + next_tokens`` (the defaults: no band), and
      what the optional fourth operand ``attn_mask`` allows.  MindSpore reads the band from
      ``attn_mask`` (pre/next_tokens only tell its kernel which blocks to skip); here both
      count, so give the defaults or the band the mask holds.
    - 1: what ``attn_mask`` allows (required then).
    - 2: top-left causal, ``j <= i``.
    - 3: bottom-right causal, ``j <= i + Skv - Sq``.
    - 4: the band from the bottom-right corner: ``|j - i - (Skv - Sq)|`` within
      ``[-pre_tokens, next_tokens]``.

    ``attn_mask`` (bool or integers, 1 or True where a query must not see a key) is
    ``(S1, S2)`` or ``(B or 1, N1 or 1, S1, S2)`` whatever the input layout; modes 2 to 4
    ignore it (MindSpore's compressed 2048 x 2048 causal mask), as TND takes none for
    modes 0 and 1.  It follows query: its S1 shards like query's rows, B and N1 (when not
    1) like query's batch and heads, S2 whole.  Modes 5 to 8 (prefix, varlen variants)
    are ``invalid-attr``.
    ``TND``: ``actual_seq_qlen`` and ``actual_seq_kvlen`` (required then, None otherwise) are
    the cumulative ends of the sequences packed along T (``[3, 5]``: tokens 0-2 and 3-4), as
    many for q as for k and v, the last one T; a query attends only to the keys of its own
    sequence, with the mask of that sequence.

    ``keep_prob`` < 1: dropout of the probabilities (kept ones scaled by ``1/keep_prob``),
    MindSpore's ``drop_mask`` drawn here by the loss family's counter-based generator:
    probability ``(b, n, i, j)`` (global batch, query head, query row, key; ``(0, n, t, j)``
    for TND) is kept when ``counter_uniform(seed, its row-major index) >= 1 - keep_prob``,
    so every layout draws what one device draws (``seed``, default 0, is this op's own
    attr; MindSpore takes the mask as a tensor instead).

    Layout rule (as ``scaled_dot_product_attention``): query drives it.  Its batch, head
    and sequence dims (T for ``TND``) shard freely; a fused ``H`` dim only into whole heads
    (else ``sharded-head-dim``, as for the head size ``D``); none is Partial
    (``partial-input``).  key and value shard B and the heads like query (grouped-query heads
    that cannot split as query's stay whole: ``sharding-mismatch`` when they are sharded
    there) and hold the whole key/value sequence (``sharded-kv-sequence``); each rank's
    kernel gets its first query row (``q_start``), the global query length (``q_total``),
    its local ``head_num`` and, for grouped-query heads, its ``kv_head_map`` (all localised).
    The output has query's shape and layout.

    ``zigzag=P`` (default 0): the sequence is stored in the zig-zag order of 2P chunks and
    the mask compares positions in the sequence, as for ``scaled_dot_product_attention``
    (one sequence of a multiple of 2P tokens; not with TND).

    Context parallelism: ``context_parallel`` ``all_gather`` (default), ``ulysses`` or
    ``auto``, as for ``scaled_dot_product_attention``: with query's sequence sharded on a
    mesh axis, gather key and value there, or move query, key and value from the sequence
    to the heads (whole heads only) by all-to-alls (Ulysses), or the one moving fewer
    bytes, or ``ring``: ring attention, as for ``scaled_dot_product_attention``
    (:mod:`.ring`): with query's, key's and value's sequence sharded on the same one mesh
    axis of n ranks, the expand pass writes n ``attention_block`` steps on q, k, v brought
    to BSND (BSH: a reshape to heads; SBH: a reshape and a transpose; BNSD and BSND as
    they are), k and v passed on by cyclic permutes (``ring_shift``), the results merged
    by their log-sum-exp and brought back.  It takes ``sparse_mode`` 0 without a band
    (the default pre/next tokens), 2 and 3 (at least as many keys as queries), ``zigzag``
    (the load-balanced order), no ``attn_mask``, no dropout, not TND; elsewhere the node
    gathers key and value and the expand pass says why in a note.

Grad op (``differentiable = False``)
    ``flash_attention_score_grad(dy, query, key, value) -> (dq, dk, dv)`` (aliases
    ``FlashAttentionScoreGrad``, ``npu_fusion_attention_grad``): dq like query; dk and dv like
    key and value, plus ``P(sum)`` on the mesh axes that shard query's sequence or its heads
    but not key's (each rank adds the contributions of its own query rows and heads).

Violation codes
---------------
- ``partial-input``: an operand is Partial (attention is not linear in it).
- ``sharded-kv-sequence``: key's or value's sequence dim is sharded (fix: all-gather).
- ``sharded-head-dim``: the head size D is sharded, or a fused H dim not into whole heads.
- ``sharding-mismatch``: key or value shard B or the heads unlike query; dy unlike the output.
- ``broadcast-shape``: a cotangent of the wrong shape.
- ``invalid-shape``: shapes the layout or head_num cannot take (ranks, B, D, head counts).
- ``invalid-attr``: an attr value the op cannot take (head_num, scale, keep_prob, seed,
  sparse_mode, pre/next_tokens, the sequence lengths, context_parallel, zigzag).
- ``invalid-input-layout``: an ``input_layout`` other than BSH, SBH, BNSD, BSND, TND.

Examples
--------
>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
>>> q = TensorSpec((2, 8, 64), "float16", Layout(mesh, ["S(0)", "S(2)"], 3))  # BSH, 4 heads of 16
>>> kv = TensorSpec((2, 8, 32), "float16", Layout(mesh, ["R", "R"], 3))      # 2 kv heads
>>> rule = get_rule("FlashAttentionScore")
>>> attrs = rule.normalize_attrs({"head_num": 4, "sparse_mode": 2})
>>> res = rule.infer_layout((q, kv, kv), attrs)
>>> str(res.outputs[0].layout), res.violations, [str(w) for w in res.wants]
('(S(0), S(2))', (), ['None', '(S(0), S(2))', '(S(0), S(2))'])
>>> local = rule.localize(attrs, (q, kv.with_layout(res.wants[1]), kv), res.outputs, 1)
>>> local["head_num"], local["kv_head_map"], local["q_start"]
(2, (0, 0), 0)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

from layout_prop.core.errors import LayoutPropError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Replicate, Shard, shard_dim
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec

from .nn import (CONTEXT_PARALLEL, _cotangent, _is_float, _is_number, _move_violations, _partial_issue, _want,
                 _with_partials, float_dtype, gqa_heads_problem, head_ranges, heads_for_sequence, kv_head_map,
                 kv_heads_follow, moved_bytes, ulysses_issue, zigzag_problems)

__all__ = ["FlashAttentionScore", "FlashAttentionScoreGrad", "FA_LAYOUTS", "get_rule"]

OP = "flash_attention_score"
#: per input_layout, the tensor dim of B, S (T), the heads (N, or H = N*D fused) and D (None: fused or absent)
FA_LAYOUTS = {
    "BSH": {"B": 0, "S": 1, "heads": 2, "D": None},
    "SBH": {"B": 1, "S": 0, "heads": 2, "D": None},
    "BNSD": {"B": 0, "S": 2, "heads": 1, "D": 3},
    "BSND": {"B": 0, "S": 1, "heads": 2, "D": 3},
    "TND": {"B": None, "S": 0, "heads": 1, "D": 2},
}
SPARSE_MODES = (0, 1, 2, 3, 4)
#: the context parallel strategies of this op (scaled_dot_product_attention's)
FA_CONTEXT_PARALLEL = CONTEXT_PARALLEL
MASK_MODES = (0, 1)  # the modes that read attn_mask; 2-4 take MindSpore's compressed causal mask, ignored here
INT32_MAX = 2 ** 31 - 1
CODES = ("partial-input", "sharded-kv-sequence", "sharded-head-dim", "sharding-mismatch", "broadcast-shape",
         "invalid-shape", "invalid-attr", "invalid-input-layout")
ATTRS = {"head_num": None, "input_layout": "BSH", "scale": 1.0, "keep_prob": 1.0, "sparse_mode": 0,
         "pre_tokens": INT32_MAX, "next_tokens": INT32_MAX, "actual_seq_qlen": None, "actual_seq_kvlen": None,
         "context_parallel": "all_gather", "seed": 0, "zigzag": 0}


def _bad_attr(message: str, hint: str) -> Violation:
    return Violation("invalid-attr", message, hint, operand="query")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# ------------------------------------------------------------------------------- attrs and shapes
def _attr_violations(attrs: dict) -> list[Violation]:
    out = []
    layout = attrs["input_layout"]
    if layout not in FA_LAYOUTS:
        out.append(Violation("invalid-input-layout", f"input_layout {layout!r} is not one of {list(FA_LAYOUTS)}",
                             "set input_layout to BSH, SBH, BNSD, BSND or TND (query, key and value alike)",
                             operand="query"))
    heads = attrs["head_num"]
    if not _is_int(heads) or heads < 1:
        out.append(_bad_attr(f"head_num={heads!r} is not a positive integer", "give head_num, query's head count"))
    if not _is_number(attrs["scale"]):
        out.append(_bad_attr(f"scale={attrs['scale']!r} is not a number", "give scale as a number (default 1.0)"))
    keep = attrs["keep_prob"]
    if not _is_number(keep) or not 0 < keep <= 1:
        out.append(_bad_attr(f"keep_prob={keep!r} is not a probability in (0, 1]", "give keep_prob in (0, 1]"))
    if not _is_int(attrs["seed"]) or attrs["seed"] < 0:
        out.append(_bad_attr(f"seed={attrs['seed']!r} is not a non-negative integer",
                             "give seed, the key of the dropout draws, as an integer"))
    mode = attrs["sparse_mode"]
    if not _is_int(mode) or mode not in SPARSE_MODES:
        out.append(_bad_attr(f"sparse_mode={mode!r} is not one of {list(SPARSE_MODES)} (0 band, 1 attn_mask only, "
                             "2 top-left causal, 3 bottom-right causal, 4 band from the bottom-right)",
                             "modes 5-8 need a prefix tensor or a varlen variant, which this op does not take"))
    for name in ("pre_tokens", "next_tokens"):
        if not _is_int(attrs[name]):
            out.append(_bad_attr(f"{name}={attrs[name]!r} is not an integer", f"give {name} as an integer"))
    zigzag = attrs["zigzag"]
    if not _is_int(zigzag) or zigzag < 0:
        out.append(_bad_attr(f"zigzag={zigzag!r} is not a non-negative integer", "give zigzag, the number of "
                             "sequence shards the zig-zag order balances (0: the natural order)"))
    elif zigzag and layout == "TND":
        out.append(_bad_attr(f"zigzag={zigzag} with input_layout TND: packed sequences keep their own order",
                             "use zigzag with one sequence per batch row (BSH, SBH, BNSD, BSND)"))
    if attrs["context_parallel"] not in FA_CONTEXT_PARALLEL:
        out.append(_bad_attr(f"context_parallel={attrs['context_parallel']!r} is not one of "
                             f"{list(FA_CONTEXT_PARALLEL)}", "all_gather gathers key and value on the axes that shard "
                             "query's sequence, ulysses moves query, key, value to their heads there, auto takes the "
                             "one moving fewer bytes, ring passes them around the ring (expanded by --reshard)"))
    if layout == "TND":
        for name in ("actual_seq_qlen", "actual_seq_kvlen"):
            if attrs[name] is None:
                out.append(_bad_attr(f"input_layout TND needs {name}", f"give {name}, the cumulative ends of the "
                                     "packed sequences ([3, 5]: tokens 0-2 and 3-4)"))
    elif layout in FA_LAYOUTS:
        for name in ("actual_seq_qlen", "actual_seq_kvlen"):
            if attrs[name] is not None:
                out.append(_bad_attr(f"{name}={attrs[name]!r} is given with input_layout {layout}",
                                     f"leave {name} out, or pack the sequences in the TND layout"))
    return out


def _cumulative_problem(name: str, ends, total: int) -> Violation | None:
    ok = isinstance(ends, (list, tuple)) and len(ends) > 0 and all(_is_int(e) and e >= 0 for e in ends)
    if ok and (list(ends) != sorted(ends) or ends[-1] != total):
        ok = False
    if ok:
        return None
    return _bad_attr(f"{name}={ends!r} is not the cumulative ends of the packed sequences (non-decreasing, "
                     f"non-negative, the last one {total}, the length of T)",
                     f"give {name} as a list such as [3, {total}]")


def _head_size(q: TensorSpec, dims: dict, heads: int) -> int | None:
    """D: query's last dim, or H1 / head_num for a fused H (None when it does not divide)."""
    if dims["D"] is not None:
        return q.shape[dims["D"]]
    h = q.shape[dims["heads"]]
    return h // heads if heads and h % heads == 0 else None


def _shape_violations(q: TensorSpec, k: TensorSpec, v: TensorSpec, attrs: dict, dims: dict) -> list[Violation]:
    layout = attrs["input_layout"]
    rank = 3 if dims["D"] is None or dims["B"] is None else 4
    out = [Violation("invalid-shape", f"{name} has rank {t.ndim} (shape {list(t.shape)}); input_layout {layout} "
                     f"takes {rank}-D query, key and value", f"reshape {name} to the {layout} layout", operand=name)
           for name, t in (("query", q), ("key", k), ("value", v)) if t.ndim != rank]
    if out:
        return out
    if tuple(v.shape) != tuple(k.shape):
        return [Violation("invalid-shape", f"value has shape {list(v.shape)} but key {list(k.shape)}: "
                          "flash_attention_score takes value of key's shape", "give value key's shape",
                          operand="value")]
    heads = attrs["head_num"]
    d = _head_size(q, dims, heads)
    if d is None:
        return [Violation("invalid-shape", f"query's H (dim {dims['heads']}) is {q.shape[dims['heads']]}, not a "
                          f"multiple of head_num={heads}", "give head_num, the number of query heads, so that "
                          "H = head_num * D", operand="query")]
    if dims["D"] is None:
        kv_h = k.shape[dims["heads"]]
        if d == 0 or kv_h % d:
            return [Violation("invalid-shape", f"key's H (dim {dims['heads']}) is {kv_h}, not a multiple of the head "
                              f"size D = {d} (query's H {q.shape[dims['heads']]} / head_num {heads})",
                              "give key and value H = N2 * D", operand="key")]
        kv_heads = kv_h // d
    else:
        if q.shape[dims["heads"]] != heads:
            return [_bad_attr(f"head_num={heads} but query has {q.shape[dims['heads']]} heads (dim {dims['heads']} "
                              f"of {list(q.shape)})", f"give head_num={q.shape[dims['heads']]}")]
        if k.shape[dims["D"]] != d:
            return [Violation("invalid-shape", f"key's D (dim {dims['D']}) is {k.shape[dims['D']]} but query's is "
                              f"{d}", "give query and key the same head size", operand="key")]
        kv_heads = k.shape[dims["heads"]]
    if dims["B"] is not None and k.shape[dims["B"]] != q.shape[dims["B"]]:
        out.append(Violation("invalid-shape", f"key's B (dim {dims['B']}) is {k.shape[dims['B']]} but query's is "
                             f"{q.shape[dims['B']]}", "give query, key and value the same batch", operand="key"))
    problem = gqa_heads_problem(heads, kv_heads, f"head_num {heads}", (q, k, v))
    if problem is not None:
        out.append(problem)
    if attrs["zigzag"] and not out:
        out += zigzag_problems(q.shape[dims["S"]], k.shape[dims["S"]], attrs["zigzag"], "query")
    if layout == "TND" and not out:
        for name, t in (("actual_seq_qlen", q), ("actual_seq_kvlen", k)):
            problem = _cumulative_problem(name, attrs[name], t.shape[0])
            if problem is not None:
                out.append(problem)
        if not out and len(attrs["actual_seq_qlen"]) != len(attrs["actual_seq_kvlen"]):
            out.append(_bad_attr(f"actual_seq_qlen has {len(attrs['actual_seq_qlen'])} sequences but "
                                 f"actual_seq_kvlen {len(attrs['actual_seq_kvlen'])}",
                                 "give both the same number of sequences"))
    return out


# ------------------------------------------------------------------------------------ layouts
class _Heads:
    """How the heads lie along a dim: the dim, and the elements of one head along it (D fused, else 1)."""

    def __init__(self, q: TensorSpec, dims: dict, attrs: dict) -> None:
        self.dim = dims["heads"]
        self.unit = _head_size(q, dims, attrs["head_num"]) if dims["D"] is None else 1
        self.fused = dims["D"] is None

    def whole(self, spec: TensorSpec, axes: Sequence[int]) -> bool:
        """Whether ``spec``'s pieces on ``axes`` are whole heads."""
        if not self.fused:
            return True
        try:
            return head_ranges(spec, self.dim, axes, self.unit) is not None
        except LayoutPropError:
            return False

    def count(self, spec: TensorSpec) -> int:
        return spec.shape[self.dim] // self.unit if self.unit else 0


def _query_layout(q: TensorSpec, dims: dict, heads: _Heads) -> tuple[Layout, list]:
    """Query's layout with its Partial axes reduced and D (or a fused H cut into parts of heads) unsharded."""
    ps, issues = [], []
    head_axes = q.layout.dim_axes(heads.dim)
    cut_heads = heads.fused and not heads.whole(q, head_axes)
    for axis, p in enumerate(q.layout.placements):
        name = repr(q.mesh.names[axis])
        d = shard_dim(p)
        if isinstance(p, Partial):
            issues.append(_partial_issue(q, "query", axis, OP, "is not linear in it, so every rank needs whole "
                                         "values"))
            ps.append(Replicate())
        elif d is not None and (d == dims["D"] or (d == heads.dim and cut_heads)):
            what = "the head size D" if d == dims["D"] else f"H = head_num * D into parts of heads (D = {heads.unit})"
            issues.append(("sharded-head-dim", f"query dim {d} (size {q.shape[d]}) is sharded on mesh axis {name} "
                           f"(query is {q.layout}), which cuts {what}; attention contracts over whole heads",
                           f"all-gather query on {name}, or shard B, S or a number of heads dividing the mesh axis"))
            ps.append(Replicate())
        else:
            ps.append(p)
    return Layout(q.mesh, ps, q.ndim), issues


def _kv_layout(q: TensorSpec, q_fixed: Layout, t: TensorSpec, dims: dict, heads: _Heads) -> Layout:
    """key's and value's layout: query's B and head shards (heads whole on every rank), else Replicate."""
    keep = (dims["B"], heads.dim)
    ps = [p if isinstance(p, Shard) and p.dim in keep else Replicate() for p in q_fixed.placements]
    want = Layout(t.mesh, ps, t.ndim)
    axes = want.dim_axes(heads.dim)
    if axes:
        try:
            kv = t.with_layout(want)
            follows = heads.whole(kv, axes) and kv_heads_follow(q.with_layout(q_fixed), kv, heads.dim, heads.dim,
                                                                axes, heads.unit, heads.unit)
        except LayoutPropError:  # fewer kv heads than the ranks that would split them
            follows = False
        if not follows:
            want = want.with_placements([Replicate() if a in axes else p for a, p in enumerate(ps)])
    return want


def _kv_issues(name: str, t: TensorSpec, want: Layout, q: TensorSpec, dims: dict, heads: _Heads) -> list:
    issues = []
    for axis, p in enumerate(t.layout.placements):
        axis_name = repr(t.mesh.names[axis])
        if isinstance(p, Partial):
            issues.append(_partial_issue(t, name, axis, OP, "is not linear in it, so every rank needs whole values"))
        elif isinstance(p, Shard) and p.dim == dims["S"] and want.placements[axis] == Shard(heads.dim):
            issues.append(("sharded-kv-sequence", f"{name}'s sequence dim {p.dim} (size {t.shape[p.dim]}) is sharded "
                           f"on mesh axis {axis_name} ({name} is {t.layout}); with Ulysses attention shards the heads "
                           f"there", f"all-to-all {name} on {axis_name} to its heads (dim {heads.dim})"))
        elif isinstance(p, Shard) and p.dim == dims["S"]:
            issues.append(("sharded-kv-sequence", f"{name}'s sequence dim {p.dim} (size {t.shape[p.dim]}) is sharded "
                           f"on mesh axis {axis_name} ({name} is {t.layout}); every query row attends to the whole "
                           "key/value sequence", f"all-gather {name} on {axis_name}; to split the sequence, shard "
                           f"query's sequence dim {dims['S']} instead"))
        elif isinstance(p, Shard) and p.dim == dims["D"]:
            issues.append(("sharded-head-dim", f"{name}'s head size dim {p.dim} is sharded on mesh axis {axis_name} "
                           f"({name} is {t.layout}); attention contracts over whole heads",
                           f"all-gather {name} on {axis_name}"))
        elif isinstance(p, Shard) and p != want.placements[axis]:
            q_p = q.layout.placements[axis]
            if p.dim == heads.dim and q_p == p:
                issues.append(("sharding-mismatch", f"{name}'s {heads.count(t)} heads (dim {p.dim}) cannot be split "
                               f"on mesh axis {axis_name} as query's {heads.count(q)} heads are (query is {q.layout}, "
                               f"{name} is {t.layout}): a query head's kv head would be on another rank",
                               f"all-gather {name} on {axis_name} (every rank keeps every kv head), or shard "
                               f"fewer query heads on {axis_name}"))
            else:
                issues.append(("sharding-mismatch", f"{name}'s dim {p.dim} is sharded on mesh axis {axis_name} but "
                               f"query's is not alike (query is {q.layout}, {name} is {t.layout}); key and value "
                               "follow query's batch and head sharding",
                               f"shard {name} like query on {axis_name} ({want})"))
    return issues


def _mask_violations(mask: TensorSpec | None, q: TensorSpec, k: TensorSpec, attrs: dict, dims: dict) -> list:
    """attn_mask: needed by sparse_mode 1, ``(S1, S2)`` or ``(B or 1, N1 or 1, S1, S2)`` for modes 0 and 1."""
    mode, layout = attrs["sparse_mode"], attrs["input_layout"]
    if mask is None:
        if mode == 1:
            return [_bad_attr("sparse_mode=1 (allMask) computes what attn_mask allows, but no attn_mask is given",
                              "give attn_mask as the fourth operand, or use sparse_mode 0")]
        return []
    if mode not in MASK_MODES:
        return []
    if layout == "TND":
        return [_bad_attr(f"attn_mask with input_layout TND and sparse_mode {mode}: packed sequences take "
                          "MindSpore's compressed causal masks only", "use sparse_mode 2 or 3 (no mask needed)")]
    sq, skv, b = q.shape[dims["S"]], k.shape[dims["S"]], q.shape[dims["B"]]
    n = attrs["head_num"]
    fits = mask.ndim in (2, 4) and tuple(mask.shape[-2:]) == (sq, skv) and \
        (mask.ndim == 2 or (mask.shape[0] in (1, b) and mask.shape[1] in (1, n)))
    if fits:
        return []
    return [Violation("invalid-shape", f"attn_mask has shape {list(mask.shape)}, but query {list(q.shape)} and key "
                      f"{list(k.shape)} ({layout}) take ({sq}, {skv}) or ({b} or 1, {n} or 1, {sq}, {skv})",
                      "give attn_mask the shape (S1, S2) or (B, N1, S1, S2), 1 or True where a query must not "
                      "see a key", operand="attn_mask")]


def _mask_layout(mask: TensorSpec, q_fixed: Layout, dims: dict, heads: _Heads) -> Layout:
    """attn_mask's layout: query's row shards on S1, its batch and head shards on B and N1 (when not 1)."""
    ps = []
    for p in q_fixed.placements:
        target = Replicate()
        if isinstance(p, Shard):
            if p.dim == dims["S"]:
                target = Shard(mask.ndim - 2)
            elif mask.ndim == 4 and p.dim == dims["B"] and mask.shape[0] > 1:
                target = Shard(0)
            elif mask.ndim == 4 and p.dim == heads.dim and mask.shape[1] > 1:
                target = Shard(1)
        ps.append(target)
    return Layout(mask.mesh, ps, mask.ndim)


def _mask_issues(mask: TensorSpec, want: Layout) -> list:
    issues = []
    for axis, (p, w) in enumerate(zip(mask.layout.placements, want.placements)):
        if p == w:
            continue
        name = repr(mask.mesh.names[axis])
        if isinstance(p, Partial):
            issues.append(_partial_issue(mask, "attn_mask", axis, OP, "reads it whole, as a mask"))
        else:
            issues.append(("sharding-mismatch", f"attn_mask is {p} on mesh axis {name} but {w} there follows "
                           f"query's rows, batch and heads (attn_mask is {mask.layout})",
                           f"give attn_mask the layout {want}"))
    return issues


def _analysis(q: TensorSpec, k: TensorSpec, v: TensorSpec, attrs: dict, mask: TensorSpec | None = None):
    """``(q_fixed, kv_wants, wants, violations, dims, heads)``; ``q_fixed`` None when unusable.

    ``wants`` has one more entry, attn_mask's, when a mask is given.
    """
    violations = _attr_violations(attrs)
    dims = FA_LAYOUTS.get(attrs["input_layout"])
    if not violations:
        violations = _shape_violations(q, k, v, attrs, dims)
    if not violations:
        violations = _mask_violations(mask, q, k, attrs, dims)
    if violations:
        return None, (None, None), [None, None, None], violations, dims, None
    heads = _Heads(q, dims, attrs)
    q_fixed, issues = _query_layout(q, dims, heads)
    heads_layout = _ulysses(q, k, v, q_fixed, attrs["context_parallel"], dims, heads)
    if heads_layout is not None:
        issues = issues + [ulysses_issue(q, q_fixed, heads_layout, "query", attrs["context_parallel"])]
        q_fixed = heads_layout
    violations = _move_violations(q, q_fixed, "query", issues)
    wants: list[Layout | None] = [_want(q_fixed, q)]
    kv_wants = []
    for name, t in (("key", k), ("value", v)):
        want = _kv_layout(q, q_fixed, t, dims, heads)
        violations += _move_violations(t, want, name, _kv_issues(name, t, want, q, dims, heads))
        wants.append(_want(want, t))
        kv_wants.append(want)
    if mask is not None:
        want = _mask_layout(mask, q_fixed, dims, heads) if attrs["sparse_mode"] in MASK_MODES else mask.layout
        violations += _move_violations(mask, want, "attn_mask", _mask_issues(mask, want))
        wants.append(_want(want, mask))
    return q_fixed, tuple(kv_wants), wants, violations, dims, heads


def _ulysses(q: TensorSpec, k: TensorSpec, v: TensorSpec, q_fixed: Layout, mode: str, dims: dict,
             heads: _Heads) -> Layout | None:
    """The heads-sharded layout query moves to for Ulysses, or None to gather key and value (``nn._ulysses``)."""
    if mode not in ("ulysses", "auto"):
        return None
    heads_layout = heads_for_sequence(q, q_fixed, dims["S"], heads.dim)
    if heads_layout is None or not heads.whole(q.with_layout(heads_layout), heads_layout.dim_axes(heads.dim)):
        return None
    kv_wants = [_kv_layout(q, heads_layout, t, dims, heads) for t in (k, v)]
    if any(w.dim_axes(heads.dim) != heads_layout.dim_axes(heads.dim) for w in kv_wants):
        return None
    if mode == "ulysses":
        return heads_layout
    out = TensorSpec(q.shape, q.dtype, heads_layout)
    gather = sum(moved_bytes(t, _kv_layout(q, q_fixed, t, dims, heads)) for t in (k, v))
    alltoall = moved_bytes(q, heads_layout) + sum(moved_bytes(t, w) for t, w in zip((k, v), kv_wants)) + \
        moved_bytes(out, q_fixed)
    return heads_layout if alltoall < gather else None


def _localized(attrs: dict, q: TensorSpec, k: TensorSpec, rank: int) -> dict:
    """A rank's attrs: its first query row and the global query length (the masks), its head count
    and, for grouped-query heads, which local kv head each local query head uses."""
    dims = FA_LAYOUTS[attrs["input_layout"]]
    heads = _Heads(q, dims, attrs)
    q_slices, k_slices = q.local_slices(rank), k.local_slices(rank)
    unit = heads.unit or 1
    q_heads = tuple(b // unit for b in q_slices[heads.dim])
    out = {**attrs, "q_start": q_slices[dims["S"]][0], "q_total": q.shape[dims["S"]],
           "head_num": q_heads[1] - q_heads[0]}
    if heads.count(q) != heads.count(k):
        kv_heads = tuple(b // unit for b in k_slices[heads.dim])
        out["kv_head_map"] = kv_head_map(q_heads, kv_heads, heads.count(q) // heads.count(k))
    if attrs["keep_prob"] != 1:  # the dropout draws are keyed by the global (B, N1, S1, S2) index
        b = dims["B"]
        out.update(b_start=0 if b is None else q_slices[b][0], b_total=1 if b is None else q.shape[b],
                   head_start=q_heads[0], head_total=heads.count(q))
    return out


@register_op
class FlashAttentionScore(OpRule):
    """``flash_attention_score(query, key, value, head_num, input_layout="BSH", ...)``: see the module docstring."""

    name = OP
    operands = ("query", "key", "value")
    optional_operands = ("attn_mask",)
    aliases = ("FlashAttentionScore", "npu_fusion_attention")
    attr_defaults = dict(ATTRS)
    required_attrs = ("head_num",)
    violation_codes = CODES

    def infer_layout(self, inputs, attrs):
        q, k, v = inputs[:3]
        mask = inputs[3] if len(inputs) > 3 else None
        q_fixed, _, wants, violations, _, _ = _analysis(q, k, v, attrs, mask)
        out = None
        if q_fixed is not None:
            out = TensorSpec(q.shape, float_dtype(q.dtype, k.dtype, v.dtype), q_fixed)
        if attrs["context_parallel"] == "ring":  # the expand pass writes the ring where it applies
            violations = [dataclasses.replace(v, hint=f"{v.hint}; with context_parallel='ring', --reshard passes "
                                              "k and v around the ring instead (a permute a step) where query, key "
                                              "and value shard their sequence on one mesh axis")
                          if v.code == "sharded-kv-sequence" else v for v in violations]
        return RuleResult((out,), tuple(violations), tuple(wants))

    def localize(self, attrs, inputs, outputs, rank):
        return _localized(attrs, inputs[0], inputs[1], rank)

    def expand(self, b, inputs, attrs, specs):
        from .ring import flash_ring_attention  # context_parallel='ring'

        return flash_ring_attention(b, inputs, attrs, specs)

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None,) * len(inputs)
        grads = g.op(f"{OP}_grad", [dy, *inputs], dict(attrs), num_outputs=3)
        out = tuple(gv if need and _is_float(g.spec(i).dtype) else None for gv, need, i in zip(grads, needs, inputs))
        return out + (None,) * (len(inputs) - 3)  # no gradient for attn_mask


@register_op
class FlashAttentionScoreGrad(OpRule):
    """``flash_attention_score_grad(dy, query, key, value) -> (dq, dk, dv)``.

    dq takes query's layout; dk and dv take key's and value's, plus ``P(sum)`` on every
    mesh axis that shards query's sequence, or its heads but not key's.  Localised as the
    forward.
    """

    name = f"{OP}_grad"
    operands = ("dy", "query", "key", "value")
    optional_operands = ("attn_mask",)
    aliases = ("FlashAttentionScoreGrad", "npu_fusion_attention_grad")
    num_outputs = 3
    attr_defaults = dict(ATTRS)
    required_attrs = ("head_num",)
    violation_codes = CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, q, k, v = inputs[:4]
        mask = inputs[4] if len(inputs) > 4 else None
        q_fixed, kv_wants, wants, violations, dims, heads = _analysis(q, k, v, attrs, mask)
        if q_fixed is None:
            return RuleResult((None,) * 3, tuple(violations), ())
        dy_want, partials, dy_violations, dy_ok = _cotangent(dy, q_fixed, q.shape, OP)
        violations = dy_violations + violations
        if not dy_ok:
            return RuleResult((None,) * 3, tuple(violations), ())
        seq_axes = set(q_fixed.dim_axes(dims["S"]))
        grads = [TensorSpec(q.shape, q.dtype, _with_partials(q_fixed, partials))]
        for t, want in zip((k, v), kv_wants):
            summed = seq_axes | (set(q_fixed.dim_axes(heads.dim)) - set(want.dim_axes(heads.dim)))
            ps = [partials.get(a, Partial("sum") if a in summed else p) for a, p in enumerate(want.placements)]
            grads.append(TensorSpec(t.shape, t.dtype, Layout(t.mesh, ps, t.ndim)))
        return RuleResult(tuple(grads), tuple(violations), (_want(dy_want, dy), *wants))

    def localize(self, attrs, inputs, outputs, rank):
        return _localized(attrs, inputs[1], inputs[2], rank)
