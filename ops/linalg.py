"""Linear algebra, embedding and reduction ops: layout rules and gradient rules.

The matmul family is described declaratively by einsum equations, and ONE sharding
rule (:func:`einsum_layout`) serves all of them:

- ``einsum(x0, x1, ..., equation="bmk,kn->bmn")``: the generic op (explicit ``->``
  output, letters only: no ellipsis, no repeated letter inside one operand).  A letter
  held with size 1 by one operand and size n by another broadcasts (numpy rules).
  Every letter missing from the output must appear with its full size in at least two
  operands (no summing a letter out of a single operand: use ``sum``), so that every
  gradient is again such an einsum.
- ``matmul(x, w, transpose_a, transpose_b)``: ``x (..., m, k) @ w (k, n)``, ``w`` 2-D;
  equation ``[batch]mk,kn->[batch]mn``.
- ``batch_matmul(x, w, transpose_a, transpose_b)``: both at least 2-D, leading batch
  dims aligned from the right and broadcast (``torch.matmul``); ``bmk,bkn->bmn``.
- ``linear(x, weight[, bias])``: ``x @ weight.T + bias`` with ``weight (out, in)`` as in
  torch; ``[batch]i,oi->[batch]o``.  One op with an optional third operand, as
  ``torch.nn.functional.linear`` and MindSpore ``Dense``: the rule class overrides
  ``check_arity`` and ``operand_name`` (the registry has no optional operands yet).
  The bias is an *additive* operand: it shards like the output letter ``o``; where the
  product is ``P(sum)`` (row-parallel linear) a Replicate bias is added on the ranks at
  coordinate 0 of those mesh axes only (localised attr ``add_bias``), a ``P(sum)`` bias
  on every rank, so the partial sum still adds the bias exactly once.

The einsum sharding rule, per mesh axis:

- a letter sharded on a mesh axis in one operand must be sharded on that axis in every
  operand that holds the letter at full size (a broadcast size-1 dim stays Replicate);
  a strided shard ``_S(d,k)`` of a letter (a reshape merged it) likewise cuts every
  operand holding the letter, and the output, as ``_S`` with the same k;
  a Replicate operand is sliced for free.  When operands disagree the rule keeps the
  choice that moves the fewest bytes (so the larger operand stays in place; ties keep
  the earlier operand) and reports ``sharding-mismatch`` for the others;
- the output keeps the shards of its letters; a sharded letter that is contracted (not
  in the output) leaves ``P(sum)`` on that mesh axis; batch letters shard together;
- the op is linear in each operand: one operand ``P(sum)`` (or ``P(avg)``) with every
  other operand Replicate on that axis passes through as the same Partial; two partial
  operands, a ``P(max)``/``P(min)`` operand, or a partial operand beside a sharded one
  is ``partial-input`` (the cheaper of reducing it or gathering the others is wanted).
  Reducing a partial operand is costed at twice its bytes (an all-reduce), gathering a
  sharded one at its bytes, counting the bytes a rank handles: the operand's size over
  its shards on the other mesh axes (a batch cut on ``dp`` is that much smaller on ``tp``).

Lowering needs no localised attrs for the products: consistent letters give matching
local shapes (uneven and empty chunks included).  Gradients are einsums of the
cotangent through the generic ``einsum`` op (``dA_i = einsum(out, others -> A_i)``),
followed by ``sum_to`` where ``A_i`` broadcast a batch letter; the bias gradient is a
``sum`` over the rows, ``P(sum)`` where rows are sharded.

``embedding(ids, table)``: ``ids`` an integer tensor of any shape, ``table (vocab,
hidden)``; the output is ``ids.shape + (hidden,)``.  Ids outside ``[0, vocab)`` give
zero rows (everywhere, the single-device reference included), which is what makes
vocabulary parallelism exact.  Per mesh axis: ``table`` sharded on the vocabulary dim
gives ``P(sum)`` (each rank looks up only the ids in its range; the kernel gets the
rank's first vocabulary row as the localised attr ``vocab_start``); ``table`` sharded
on the hidden dim gives the output's last dim sharded; ``ids`` sharded on a dim shard
the output there; a ``P(sum|avg)`` table with Replicate ids passes through (a lookup is
linear in the table).  Ids and table both sharded on one mesh axis: the larger stays
(``sharding-mismatch`` for the other).  The gradient ``embedding_grad(dy, ids)``
scatter-adds ``dy`` into a ``(vocab, hidden)`` table: vocabulary-sharded on the ranks'
rows (localised attrs ``vocab_start``, ``num_embeddings``), hidden-sharded like ``dy``,
``P(sum)`` where the ids are sharded.  Ids get no gradient.  MindSpore ``Gather`` and
``aten.embedding`` take the table first, so they are not aliases.

``sum``, ``mean``, ``max`` over ``dims`` (a list, an int, or ``None`` for every dim;
``[]`` reduces nothing as in numpy) with ``keepdim``: a sharded reduced dim gives
``P(sum)`` (sum), ``P(sum)`` (mean: each rank sums its piece and scales by one over the
*global* count, the localised attr ``count``, so uneven and empty pieces are exact;
the average of local means would not be), ``P(max)`` (max; an empty piece gives the
dtype's lowest value).  Kept dims keep their shards (renumbered).  Partial inputs: sum
and mean are linear (``P(sum)``, ``P(avg)`` pass through); max passes ``P(max)`` through
and reports ``partial-input`` for ``P(sum)``/``P(avg)``/``P(min)``.  Gradients:
``sum_grad`` broadcasts the cotangent back (times ``1/count`` for mean) into x's layout;
``max_grad`` sends the cotangent to every element equal to the maximum.  Ties: each
tied element gets the whole cotangent (the kernel and the single-device reference
alike; torch's ``amax`` splits it evenly instead, which would need a global tie count).
mean of an integer tensor is float32.

Violation codes: ``partial-input``, ``sharding-mismatch``, ``broadcast-shape``,
``invalid-equation``, ``invalid-rank``, ``invalid-dtype``, ``invalid-dims``.

Examples
--------
Column-parallel then row-parallel linear (Megatron) on a ``tp`` axis:

>>> from layout_prop import DeviceMesh, Layout, TensorSpec
>>> mesh = DeviceMesh((2,), ("tp",))
>>> def spec(shape, placement):
...     return TensorSpec(shape, "float32", Layout(mesh, [placement], len(shape)))
>>> col = get_rule("linear").infer_layout((spec((4, 8, 16), "R"), spec((32, 16), "S(0)")), {})
>>> str(col.outputs[0].layout), col.violations
('(S(2))', ())
>>> row = get_rule("Dense").infer_layout((spec((4, 8, 32), "S(2)"), spec((16, 32), "S(1)")), {})
>>> str(row.outputs[0].layout)
'(P(sum))'
>>> get_rule("ReduceMean").infer_layout((spec((5, 3), "S(0)"),), {"dims": [0]}).outputs[0].layout.placements
(Partial(reduce_op='sum'),)
"""

from __future__ import annotations

from abc import abstractmethod

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from layout_prop.core.errors import LayoutPropError, OpError, Violation
from layout_prop.core.layout import Layout
from layout_prop.core.placement import Partial, Placement, Replicate, Shard, StridedShard
from layout_prop.core.registry import OpRule, RuleResult, get_rule, register_op
from layout_prop.core.spec import TensorSpec, is_float_dtype, numpy_dtype

from .common import plan_summary
from .elementwise import sum_to_shape

__all__ = [
    "Equation",
    "EinsumOperand",
    "EinsumLayout",
    "parse_equation",
    "letter_sizes",
    "einsum_layout",
    "einsum_vjp",
    "embedding_analysis",
    "normalize_dims",
    "Einsum",
    "MatMul",
    "BatchMatMul",
    "Linear",
    "Embedding",
    "EmbeddingGrad",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "SumGrad",
    "MaxGrad",
    "get_rule",
]

EINSUM_CODES = ("partial-input", "sharding-mismatch", "broadcast-shape", "invalid-equation", "invalid-rank")
EMBEDDING_CODES = ("partial-input", "sharding-mismatch", "broadcast-shape", "invalid-rank", "invalid-dtype")
REDUCE_CODES = ("partial-input", "sharding-mismatch", "invalid-dims")
REDUCE_GRAD_CODES = REDUCE_CODES + ("broadcast-shape",)
LINEAR_PARTIALS = ("sum", "avg")  # the Partial ops a linear map passes through
# batch letters avoid the letters of the matrix dims (m, k, n) and of linear (i, o)
BATCH_LETTERS = "abcdefghjlpqrstuvwxyz"
MOVE_COST_SHARD = 1  # gathering (or all-to-all) a sharded operand: ~ its bytes
MOVE_COST_PARTIAL = 2  # reducing a partial operand: an all-reduce, ~ twice its bytes


def _axis(mesh, axis: int) -> str:
    return repr(mesh.names[axis])


# ===================================================================== equations
@dataclass(frozen=True)
class Equation:
    """An einsum equation: one subscript per operand and the output subscript.

    Examples
    --------
    >>> eq = parse_equation("bmk,kn->bmn")
    >>> eq.inputs, eq.output, str(eq)
    (('bmk', 'kn'), 'bmn', 'bmk,kn->bmn')
    >>> eq.contracted
    ('k',)
    """

    inputs: tuple[str, ...]
    output: str

    def __str__(self) -> str:
        return ",".join(self.inputs) + "->" + self.output

    @property
    def contracted(self) -> tuple[str, ...]:
        """Letters of the inputs that the output sums over, in first-seen order."""
        seen = []
        for sub in self.inputs:
            for c in sub:
                if c not in self.output and c not in seen:
                    seen.append(c)
        return tuple(seen)


def parse_equation(text: Any) -> Equation:
    """Parse ``"ab,bc->ac"``; raises ``ValueError`` with a user-facing reason.

    Examples
    --------
    >>> parse_equation("ij->ji").inputs
    ('ij',)
    >>> parse_equation("i...,i->i")
    Traceback (most recent call last):
    ...
    ValueError: subscript 'i...' has characters other than letters (no ellipsis): write every dim as a letter
    """
    if not isinstance(text, str):
        raise ValueError(f"equation must be a string like 'mk,kn->mn', got {text!r}")
    compact = text.replace(" ", "")
    if compact.count("->") != 1:
        raise ValueError(f"equation {text!r} needs exactly one '->' followed by the output subscript")
    lhs, out = compact.split("->")
    subs = tuple(lhs.split(","))
    for sub in (*subs, out):
        if not all(c.isascii() and c.isalpha() for c in sub):
            raise ValueError(f"subscript {sub!r} has characters other than letters (no ellipsis): "
                             "write every dim as a letter")
        repeated = sorted({c for c in sub if sub.count(c) > 1})
        if repeated:
            raise ValueError(f"subscript {sub!r} repeats letter(s) {repeated} (no diagonals)")
    if not lhs:
        raise ValueError(f"equation {text!r} has no operand subscript")
    letters = set("".join(subs))
    missing = [c for c in out if c not in letters]
    if missing:
        raise ValueError(f"output letter(s) {missing} of {text!r} appear in no operand")
    for c in sorted(letters - set(out)):
        holders = [i for i, sub in enumerate(subs) if c in sub]
        if len(holders) < 2:
            raise ValueError(f"letter {c!r} is summed out of operand {holders[0]} alone; a contracted letter must "
                             "appear in at least two operands (reduce it with sum first, or keep it in the output)")
    return Equation(subs, out)


@dataclass(frozen=True)
class EinsumOperand:
    """One operand of the sharding rule: its name, spec, letters, and whether it is added.

    An additive operand (linear's bias) holds output letters only; it shards like the
    output and is added, not multiplied.
    """

    name: str
    spec: TensorSpec
    letters: str
    additive: bool = False

    def holds(self, letter: str, sizes: dict[str, int]) -> bool:
        """Whether the operand has ``letter`` at its full size (not broadcast)."""
        return letter in self.letters and self.spec.shape[self.letters.index(letter)] == sizes[letter]

    def dim_of(self, letter: str) -> int:
        return self.letters.index(letter)

    def describe_dim(self, dim: int) -> str:
        return f"{self.name} dim {dim} (letter {self.letters[dim]!r}, size {self.spec.shape[dim]})"


def letter_sizes(operands: Sequence[EinsumOperand], eq_title: str,
                 output: str) -> tuple[dict[str, int], list[Violation]]:
    """The full size of every letter, and ``broadcast-shape`` violations.

    Sizes of one letter must be equal or 1 (broadcast); a contracted letter must have its
    full size in at least two multiplied operands.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> ops = [EinsumOperand(n, TensorSpec(s, "float32", Layout(mesh, ["R"], 2)), l)
    ...        for n, s, l in (("x", (3, 5), "mk"), ("w", (4, 2), "kn"))]
    >>> sizes, found = letter_sizes(ops, "matmul 'mk,kn->mn'", "mn")
    >>> print(found[0].message)
    x dim 1 (letter 'k', size 5) and w dim 0 (letter 'k', size 4) differ; in matmul 'mk,kn->mn' the sizes of one letter must be equal, or 1 to broadcast
    """
    sizes: dict[str, int] = {}
    where: dict[str, tuple[EinsumOperand, int]] = {}  # an operand dim holding the letter at its size so far
    violations = []
    for op in operands:
        for dim, c in enumerate(op.letters):
            n = op.spec.shape[dim]
            if c not in sizes or (sizes[c] == 1 and n != 1):
                sizes[c] = n
                where[c] = (op, dim)
            elif n not in (1, sizes[c]):
                other, odim = where[c]
                violations.append(Violation(
                    "broadcast-shape",
                    f"{other.describe_dim(odim)} and {op.describe_dim(dim)} differ; in {eq_title} the sizes of one "
                    "letter must be equal, or 1 to broadcast",
                    f"give {op.name} dim {dim} size {sizes[c]}", operand=op.name))
    if violations:
        return sizes, violations
    for c in sorted({c for op in operands if not op.additive for c in op.letters} - set(output)):
        full = [op for op in operands if not op.additive and op.holds(c, sizes)]
        if sizes[c] != 1 and len(full) < 2:
            short = [op for op in operands if not op.additive and c in op.letters and not op.holds(c, sizes)]
            op = short[0]
            violations.append(Violation(
                "broadcast-shape",
                f"letter {c!r} is contracted in {eq_title}, so it must have its full size {sizes[c]} in at least two "
                f"operands, but {op.describe_dim(op.dim_of(c))} broadcasts it",
                f"give {op.name} dim {op.dim_of(c)} size {sizes[c]}", operand=op.name))
    return sizes, violations


# ===================================================================== the einsum sharding rule
@dataclass(frozen=True)
class AxisPlan:
    """The rule's decision on one mesh axis.

    ``letter`` is the letter sharded on the axis (or None), ``kept`` the index of the
    operand that stays Partial (or None); ``output`` the output's placement there and
    ``targets`` each operand's wanted placement; ``split_factor`` > 1 when the letter
    is cut as a strided shard ``_S(d,k)`` (in every operand that holds it, and the output).
    """

    axis: int
    letter: str | None
    kept: int | None
    output: Placement
    targets: tuple[Placement, ...]
    split_factor: int = 1


@dataclass(frozen=True)
class EinsumLayout:
    """What :func:`einsum_layout` returns: the output layout, the wants, the violations."""

    output: Layout
    wants: tuple[Layout | None, ...]
    violations: tuple[Violation, ...]
    plans: tuple[AxisPlan, ...]


def _move_cost(spec: TensorSpec, axis: int, have: Placement, want: Placement, all_to_all: bool = False) -> int:
    """What moving ``spec`` from ``have`` to ``want`` on mesh axis ``axis`` costs a rank, roughly.

    The bytes a rank moves there are those of the piece the ranks along ``axis`` share: the
    tensor divided by its shards on the other mesh axes.  (Global bytes would make a data-parallel
    activation, cut on a large ``dp`` axis, look costlier to reduce on ``tp`` than gathering a
    weight every rank holds whole on ``dp``: it is not.)  With ``all_to_all``, a move from one
    cut to another costs 1/n of that (n the axis's size): each rank sends its own piece, where a
    gather receives the whole.  Not from or to a strided shard: the redistribution never re-cuts
    one in place, it gathers and slices.
    """
    if have == want or isinstance(have, Replicate):
        return 0  # nothing, or a free local slice
    factor = MOVE_COST_PARTIAL if isinstance(have, Partial) else MOVE_COST_SHARD
    pieces = 1
    for a, p in enumerate(spec.layout.placements):
        if a != axis and isinstance(p, (Shard, StridedShard)):
            pieces *= spec.mesh.shape[a]
    if all_to_all and type(have) is Shard and type(want) is Shard:  # a strided shard is gathered and sliced
        pieces *= spec.mesh.shape[axis]
    return factor * (spec.nbytes // pieces)


def _cut(dim: int, split_factor: int) -> Placement:
    """``S(dim)``, or the strided shard ``_S(dim,k)`` when ``split_factor`` k > 1."""
    return Shard(dim) if split_factor == 1 else StridedShard(dim, split_factor)


def _plan_candidate(axis: int, operands: Sequence[EinsumOperand], sizes: dict[str, int], output: str,
                    letter: str | None, kept: int | None, split_factor: int = 1) -> AxisPlan:
    if letter is not None:
        out_p: Placement = _cut(output.index(letter), split_factor) if letter in output else Partial("sum")
    elif kept is not None:
        out_p = operands[kept].spec.layout.placements[axis]
    else:
        out_p = Replicate()
    targets = []
    for i, op in enumerate(operands):
        have = op.spec.layout.placements[axis]
        if i == kept:
            targets.append(have)
        elif op.additive and isinstance(have, Partial) and have == out_p:
            targets.append(have)  # a partial addend of a same-partial product: each rank adds its term
        elif letter is not None and not (op.additive and isinstance(out_p, Partial)) and op.holds(letter, sizes):
            targets.append(_cut(op.dim_of(letter), split_factor))
        else:
            targets.append(Replicate())
    return AxisPlan(axis, letter, kept, out_p, tuple(targets), split_factor)


def _choose_axis(axis: int, operands: Sequence[EinsumOperand], sizes: dict[str, int], output: str,
                 strided: bool = True) -> AxisPlan:
    """The cheapest consistent plan for one mesh axis (ties: letters in operand order, then
    a kept partial, then nothing sharded).  A strided shard of a letter is a candidate too
    (``strided``): every operand holding the letter, and the output, cut alike."""
    candidates: list[tuple[str | None, int | None, int]] = []
    for op in operands:
        p = op.spec.layout.placements[axis]
        if isinstance(p, Shard) or (strided and isinstance(p, StridedShard)):
            candidate = (op.letters[p.dim], None, p.split_factor if isinstance(p, StridedShard) else 1)
            if candidate not in candidates:
                candidates.append(candidate)
    for i, op in enumerate(operands):
        p = op.spec.layout.placements[axis]
        if not op.additive and isinstance(p, Partial) and p.reduce_op in LINEAR_PARTIALS:
            candidates.append((None, i, 1))
    candidates.append((None, None, 1))
    best, best_cost = None, None
    for letter, kept, split_factor in candidates:
        plan = _plan_candidate(axis, operands, sizes, output, letter, kept, split_factor)
        # an operand re-cut to the letter moves by an all-to-all, priced as such when the letter
        # stays in the output; when it is contracted, the gather-sized price stands in for the
        # partial sum the product leaves (reduced later, at least a reduce-scatter of the output)
        kept_letter = letter is not None and letter in output
        cost = sum(_move_cost(op.spec, axis, op.spec.layout.placements[axis], t, kept_letter)
                   for op, t in zip(operands, plan.targets))
        if best_cost is None or cost < best_cost:
            best, best_cost = plan, cost
    assert best is not None
    return best


def _axis_problem(i: int, plan: AxisPlan, operands: Sequence[EinsumOperand], title: str) -> tuple[str, str, str]:
    """(code, message, hint) for operand ``i`` that must move on ``plan.axis``."""
    op = operands[i]
    mesh = op.spec.mesh
    ax = _axis(mesh, plan.axis)
    have = op.spec.layout.placements[plan.axis]
    want = plan.targets[i]
    values = "; ".join(f"{o.name} is {o.spec.layout}" for o in operands)
    kept = operands[plan.kept] if plan.kept is not None else None
    holder = None  # another operand sharded on the chosen letter there
    for other in operands:
        if other is not op and plan.letter is not None and plan.letter in other.letters \
                and other.spec.layout.placements[plan.axis] == Shard(other.dim_of(plan.letter)):
            holder = other
            break
    if isinstance(have, Partial):
        reduce = f"reduce {op.name} on {ax} first ({'reduce-scatter' if isinstance(want, Shard) else 'all-reduce'})"
        if op.additive:
            return ("partial-input", f"{op.name} is {have} on mesh axis {ax} but the product in {title} is {plan.output} "
                    f"there; {op.name} is added, so it may stay partial only where the product is the same partial "
                    f"({values})", reduce)
        if have.reduce_op not in LINEAR_PARTIALS:
            return ("partial-input", f"{op.name} is {have} on mesh axis {ax}; {title} is linear in each operand, so "
                    f"only P(sum) and P(avg) pass through it, not {have} ({values})", reduce)
        if kept is not None:
            return ("partial-input", f"{op.name} and {kept.name} are both partial on mesh axis {ax} ({op.name} "
                    f"{have}, {kept.name} {kept.spec.layout.placements[plan.axis]}); {title} is linear in each "
                    f"operand separately, so at most one operand may be partial on a mesh axis ({values})",
                    reduce + f"; --reshard reduces the cheaper operand and keeps {kept.name} partial")
        if holder is not None:
            d = holder.dim_of(plan.letter)
            return ("partial-input", f"{op.name} is {have} on mesh axis {ax} while {holder.describe_dim(d)} is sharded "
                    f"there; in {title} a partial operand passes through only when every other operand is Replicate "
                    f"on that mesh axis ({values})",
                    reduce + f" (cheaper than gathering {holder.name}), or all-gather {holder.name} on {ax}")
        return ("partial-input", f"{op.name} is {have} on mesh axis {ax}, which {title} cannot pass through "
                f"({values})", reduce)
    desc = op.describe_dim(have.dim)
    if kept is not None:
        kp = kept.spec.layout.placements[plan.axis]
        return ("sharding-mismatch", f"{desc} is sharded on mesh axis {ax} while {kept.name} is {kp} there; in "
                f"{title} a partial operand passes through only when every other operand is Replicate on that "
                f"mesh axis ({values})",
                f"all-gather {op.name} on {ax} (--reshard does: cheaper than reducing {kept.name}), or reduce "
                f"{kept.name} on {ax} first")
    if op.additive and isinstance(plan.output, Partial):
        return ("sharding-mismatch", f"{desc} is sharded on mesh axis {ax} but the product in {title} is "
                f"{plan.output} there, not split along letter {op.letters[have.dim]!r}; {op.name} is added to that "
                f"product, so it must not be split on {ax} either ({values})",
                f"keep {op.name} Replicate on {ax} (all-gather it), or avoid contracting a sharded letter on {ax}")
    if holder is not None:
        d = holder.dim_of(plan.letter)
        return ("sharding-mismatch", f"{desc} is sharded on mesh axis {ax} but {holder.describe_dim(d)} is sharded "
                f"there; in {title} a mesh axis must shard the same letter in every operand that holds it "
                f"({values})",
                _holder_fix(op, holder, want, ax) + ", " + _other_fix(op, holder, have.dim, ax))
    return ("sharding-mismatch", f"{desc} is sharded on mesh axis {ax} but {title} needs {want} there ({values})",
            f"give {op.name} {want} on {ax}")


def _holder_fix(op, holder, want: Placement, ax: str) -> str:
    """What --reshard does to ``op``, whose letter on ``ax`` differs from ``holder``'s: re-cut it to the holder's
    letter (an all-to-all, when that is ``want``), else gather it."""
    if type(want) is Shard:
        return f"re-cut {op.name} to {want} on {ax} by an all-to-all (--reshard does: {holder.name} stays in place)"
    return f"all-gather {op.name} on {ax} (--reshard does: {holder.name} is at least as large, so it stays in place)"


def _other_fix(op, holder, dim: int, ax: str) -> str:
    """The alternative to gathering ``op``: move ``holder``'s shard to ``op``'s letter where it has it."""
    letter = op.letters[dim]
    if letter in holder.letters:
        return f"or shard letter {letter!r} of {holder.name} on {ax} instead"
    return f"or all-gather {holder.name} on {ax} instead ({holder.name} has no letter {letter!r} to shard)"


def _move_violations(spec: TensorSpec, want: Layout, operand: str,
                     problems: list[tuple[int, tuple[str, str, str]]]) -> list[Violation]:
    """One violation per mesh axis that needs communication (none when the whole move is free)."""
    if want == spec.layout:
        return []
    free, fixable, text = plan_summary(spec, want)
    if free:
        return []
    details = {"want": [str(p) for p in want.placements]}
    out = [Violation(code, message, hint, operand=operand, fixable=fixable,
                     details={**details, "mesh_axis": spec.mesh.names[axis]})
           for axis, (code, message, hint) in problems]
    if not out:  # a move the per-axis analysis thought free; report it rather than hide it
        out.append(Violation("sharding-mismatch", f"{operand} is {spec.layout} but must be {want} ({text})",
                             f"give {operand} the layout {want}", operand=operand, fixable=fixable, details=details))
    return out


def einsum_layout(operands: Sequence[EinsumOperand], output: str, sizes: dict[str, int], title: str) -> EinsumLayout:
    """The einsum sharding rule over every mesh axis (see the module docstring).

    Parameters
    ----------
    operands : sequence of EinsumOperand
        The multiplied operands, then any additive ones.
    output : str
        The output subscript.
    sizes : dict
        Every letter's full size (from :func:`letter_sizes`).
    title : str
        How messages name the op, e.g. ``"matmul 'mk,kn->mn'"``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = EinsumOperand("x", TensorSpec((8, 4), "float32", Layout(mesh, ["S(1)"], 2)), "mk")
    >>> w = EinsumOperand("w", TensorSpec((4, 6), "float32", Layout(mesh, ["R"], 2)), "kn")
    >>> res = einsum_layout([x, w], "mn", {"m": 8, "k": 4, "n": 6}, "matmul")
    >>> str(res.output), [str(w) for w in res.wants], res.violations
    ('(P(sum))', ['None', '(S(0))'], ())
    """
    mesh = operands[0].spec.mesh
    plans = tuple(_choose_axis(a, operands, sizes, output) for a in range(mesh.ndim))
    if any(p.split_factor > 1 for p in plans) and not _strided_plans_fit(plans, operands, output, sizes):
        # a strided cut of a letter inside another axis's cut of it that leaves pieces the
        # blocks do not divide: no layout holds it; strided operands are gathered instead
        plans = tuple(_choose_axis(a, operands, sizes, output, strided=False) for a in range(mesh.ndim))
    out_layout = Layout(mesh, [p.output for p in plans], len(output))
    wants: list[Layout | None] = []
    violations: list[Violation] = []
    for i, op in enumerate(operands):
        want = Layout(mesh, [p.targets[i] for p in plans], op.spec.ndim)
        wants.append(None if want == op.spec.layout else want)
        problems = [(p.axis, _axis_problem(i, p, operands, title)) for p in plans
                    if p.targets[i] != op.spec.layout.placements[p.axis]
                    and not isinstance(op.spec.layout.placements[p.axis], Replicate)]
        violations += _move_violations(op.spec, want, op.name, problems)
    return EinsumLayout(out_layout, tuple(wants), tuple(violations), plans)


def _strided_plans_fit(plans, operands: Sequence[EinsumOperand], output: str, sizes: dict[str, int]) -> bool:
    """Whether the output and every wanted operand layout are layouts of their shapes."""
    mesh = operands[0].spec.mesh
    try:
        TensorSpec(tuple(sizes[c] for c in output), "float32", Layout(mesh, [p.output for p in plans], len(output)))
        for i, op in enumerate(operands):
            op.spec.with_layout(Layout(mesh, [p.targets[i] for p in plans], op.spec.ndim))
    except LayoutPropError:
        return False
    return True


def einsum_vjp(g, inputs: Sequence[str], eq: Equation, cotangent: str | None,
               needs: Sequence[bool]) -> tuple[str | None, ...]:
    """Gradients of ``einsum(eq)``: ``dA_i = einsum(out, A_j (j != i) -> A_i)``, summed back
    to ``A_i``'s shape where it broadcast a letter."""
    if cotangent is None:
        return (None,) * len(inputs)
    out = []
    for i, need in enumerate(needs):
        if not need:
            out.append(None)
            continue
        others = [j for j in range(len(inputs)) if j != i]
        equation = ",".join([eq.output] + [eq.inputs[j] for j in others]) + "->" + eq.inputs[i]
        grad = g.op("einsum", [cotangent] + [inputs[j] for j in others], {"equation": equation})
        grad = sum_to_shape(g, grad, g.spec(inputs[i]).shape)
        out.append(grad)
    return tuple(out)


def _no_outputs(violations, n: int = 1) -> RuleResult:
    return RuleResult((None,) * n, tuple(violations), ())


def _result_dtype(specs: Sequence[TensorSpec]) -> str:
    return str(np.result_type(*[np.dtype(s.dtype) for s in specs]))


# ===================================================================== the matmul family
class EinsumFamilyRule(OpRule):
    """Shared rule of ops described by an einsum equation; subclasses give :meth:`equation`.

    ``equation`` returns the equation over the multiplied operands, the letters of any
    additive operands, and rank violations.
    """

    violation_codes = EINSUM_CODES
    strided = True  # a strided shard of a letter: every operand holding it cut alike (_choose_axis)

    @abstractmethod
    def equation(self, inputs: Sequence[TensorSpec], attrs: dict) -> tuple[Equation | None, tuple[str, ...],
                                                                             list[Violation]]:
        """The op's einsum equation for these inputs, its additive operand letters, and rank violations."""

    def title(self, eq: Equation, additive: tuple[str, ...]) -> str:
        text = f"{self.name} {str(eq)!r}"
        for k, letters in enumerate(additive):
            text += f" + {self.operand_name(len(eq.inputs) + k)} {letters!r}"
        return text

    def analyse(self, inputs, attrs) -> tuple[Equation | None, dict[str, int], EinsumLayout | None,
                                              list[Violation]]:
        """``(equation, letter sizes, layout result or None, violations that stop the rule)``."""
        eq, additive, violations = self.equation(inputs, attrs)
        if eq is None or violations:
            return eq, {}, None, violations
        letters = list(eq.inputs) + list(additive)
        operands = [EinsumOperand(self.operand_name(i), spec, letters[i], additive=i >= len(eq.inputs))
                    for i, spec in enumerate(inputs)]
        title = self.title(eq, additive)
        sizes, violations = letter_sizes(operands, title, eq.output)
        if violations:
            return eq, sizes, None, violations
        return eq, sizes, einsum_layout(operands, eq.output, sizes, title), []

    def infer_layout(self, inputs, attrs):
        eq, sizes, res, violations = self.analyse(inputs, attrs)
        if res is None:
            return _no_outputs(violations)
        shape = tuple(sizes[c] for c in eq.output)
        out = TensorSpec(shape, _result_dtype(inputs), res.output)
        return RuleResult((out,), res.violations, res.wants)

    def input_scale(self, index: int, inputs, attrs) -> float:
        """1/sqrt(fan-in) for the multiplied operands after the first (the weights): the
        product of the sizes of their letters that are summed over."""
        eq, _, violations = self.equation(inputs, attrs)
        if eq is None or violations or not 0 < index < len(eq.inputs):
            return 1.0
        letters = eq.inputs[index]
        fan_in = 1
        for letter, size in zip(letters, inputs[index].shape):
            if letter not in eq.output:
                fan_in *= size
        return 1.0 / float(np.sqrt(fan_in)) if fan_in > 0 else 1.0

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        specs = tuple(g.spec(v) for v in inputs)
        eq, _, _ = self.equation(specs, attrs)
        n = len(eq.inputs)
        grads = einsum_vjp(g, inputs[:n], eq, cotangents[0], needs[:n])
        return grads + self.additive_grads(g, inputs, cotangents[0], needs[n:])

    def additive_grads(self, g, inputs, cotangent, needs) -> tuple[str | None, ...]:
        return ()


def _rank_violation(name: str, spec: TensorSpec, expected: str, hint: str) -> Violation:
    return Violation("invalid-rank", f"{name} has rank {spec.ndim} (shape {list(spec.shape)}) but {expected}", hint,
                     operand=name)


def _matmul_letters(rank: int, transpose: bool, rows: str, cols: str, batch: str) -> str:
    return batch + (cols + rows if transpose else rows + cols)


@register_op
class Einsum(EinsumFamilyRule):
    """``einsum(x0, x1, ..., equation="bmk,kn->bmn")``: the generic einsum (see the module docstring).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> a = TensorSpec((4, 3, 5), "float32", Layout(mesh, ["S(0)"], 3))
    >>> b = TensorSpec((4, 5, 2), "float32", Layout(mesh, ["R"], 3))
    >>> res = Einsum().infer_layout((a, b), {"equation": "bmk,bkn->bmn"})
    >>> str(res.outputs[0].layout), [str(w) for w in res.wants]
    ('(S(0))', ['None', '(S(0))'])
    """

    name = "einsum"
    operands = ("x0",)
    variadic = True
    aliases = ("Einsum", "aten.einsum")
    attr_defaults = {"equation": None}

    def operand_name(self, index: int) -> str:
        return f"x{index}"

    def equation(self, inputs, attrs):
        try:
            eq = parse_equation(attrs.get("equation"))
        except ValueError as err:
            return None, (), [Violation("invalid-equation", str(err), "write an equation like 'bmk,kn->bmn': one "
                                        "letter per dim, operands separated by commas, an explicit '->' output",
                                        operand="x0")]
        if len(eq.inputs) != len(inputs):
            return None, (), [Violation("invalid-equation", f"equation {str(eq)!r} has {len(eq.inputs)} operand "
                                        f"subscript(s) but the op has {len(inputs)} input(s)",
                                        "give one subscript per input", operand="x0")]
        bad = [Violation("invalid-equation", f"subscript {sub!r} of {self.operand_name(i)} has {len(sub)} letter(s) "
                         f"but {self.operand_name(i)} has rank {spec.ndim} (shape {list(spec.shape)})",
                         f"write one letter per dim of {self.operand_name(i)}", operand=self.operand_name(i))
               for i, (sub, spec) in enumerate(zip(eq.inputs, inputs)) if len(sub) != spec.ndim]
        return (None if bad else eq), (), bad


@register_op
class MatMul(EinsumFamilyRule):
    """``matmul(x, w, transpose_a=False, transpose_b=False)``: ``x (..., m, k) @ w (k, n)``.

    ``w`` is a 2-D weight; the transposes swap the last two dims (MindSpore ``MatMul``).
    For two batched operands use ``batch_matmul``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> x = TensorSpec((4, 8, 16), "float32", Layout(mesh, ["S(0)", "R"], 3))
    >>> w = TensorSpec((16, 32), "float32", Layout(mesh, ["R", "S(1)"], 2))
    >>> str(MatMul().infer_layout((x, w), {}).outputs[0].layout)
    '(S(0), S(2))'
    """

    name = "matmul"
    operands = ("x", "w")
    aliases = ("MatMul", "aten.mm", "mm")
    attr_defaults = {"transpose_a": False, "transpose_b": False}

    def equation(self, inputs, attrs):
        x, w = inputs
        bad = []
        if x.ndim < 2:
            bad.append(_rank_violation("x", x, "matmul needs x of rank >= 2 (..., m, k)", "reshape x to (..., m, k)"))
        if w.ndim != 2:
            bad.append(_rank_violation("w", w, "matmul takes a 2-D weight (k, n)",
                                       "use batch_matmul for a batched second operand"))
        if x.ndim - 2 > len(BATCH_LETTERS):
            bad.append(_rank_violation("x", x, f"at most {len(BATCH_LETTERS)} batch dims are supported",
                                       "merge batch dims with a reshape"))
        if bad:
            return None, (), bad
        batch = BATCH_LETTERS[:x.ndim - 2]
        xs = _matmul_letters(x.ndim, bool(attrs.get("transpose_a")), "m", "k", batch)
        ws = _matmul_letters(2, bool(attrs.get("transpose_b")), "k", "n", "")
        return Equation((xs, ws), batch + "mn"), (), []


@register_op
class BatchMatMul(EinsumFamilyRule):
    """``batch_matmul(x, w, transpose_a=False, transpose_b=False)``: ``torch.matmul`` of two
    operands of rank >= 2, leading batch dims aligned from the right and broadcast.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> x = TensorSpec((4, 2, 8, 16), "float32", Layout(mesh, ["S(0)"], 4))
    >>> w = TensorSpec((2, 16, 8), "float32", Layout(mesh, ["R"], 3))
    >>> res = BatchMatMul().infer_layout((x, w), {})
    >>> res.outputs[0].shape, str(res.outputs[0].layout), res.wants
    ((4, 2, 8, 8), '(S(0))', (None, None))
    """

    name = "batch_matmul"
    operands = ("x", "w")
    aliases = ("BatchMatMul", "aten.bmm", "bmm", "aten.matmul")
    attr_defaults = {"transpose_a": False, "transpose_b": False}

    def equation(self, inputs, attrs):
        x, w = inputs
        bad = [_rank_violation(n, t, "batch_matmul needs rank >= 2 (..., rows, cols)", f"reshape {n} to at least 2-D")
               for n, t in (("x", x), ("w", w)) if t.ndim < 2]
        nb = max(x.ndim, w.ndim) - 2
        if nb > len(BATCH_LETTERS):
            bad.append(_rank_violation("x", x, f"at most {len(BATCH_LETTERS)} batch dims are supported",
                                       "merge batch dims with a reshape"))
        if bad:
            return None, (), bad
        batch = BATCH_LETTERS[:nb]
        xs = _matmul_letters(x.ndim, bool(attrs.get("transpose_a")), "m", "k", batch[nb - (x.ndim - 2):])
        ws = _matmul_letters(w.ndim, bool(attrs.get("transpose_b")), "k", "n", batch[nb - (w.ndim - 2):])
        return Equation((xs, ws), batch + "mn"), (), []


@register_op
class Linear(EinsumFamilyRule):
    """``linear(x, weight[, bias])``: ``x @ weight.T + bias``, ``weight (out, in)``, ``bias (out,)``.

    Examples
    --------
    Row-parallel with a bias: the product is a partial sum, the bias is added once.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((4, 32), "float32", Layout(mesh, ["S(1)"], 2))
    >>> w = TensorSpec((16, 32), "float32", Layout(mesh, ["S(1)"], 2))
    >>> b = TensorSpec((16,), "float32", Layout(mesh, ["R"], 1))
    >>> res = Linear().infer_layout((x, w, b), {})
    >>> str(res.outputs[0].layout), res.violations
    ('(P(sum))', ())
    >>> [Linear().localize({}, (x, w, b), res.outputs, r)["add_bias"] for r in range(2)]
    [True, False]
    """

    name = "linear"
    operands = ("x", "weight")
    optional_operands = ("bias",)
    aliases = ("Linear", "Dense", "aten.linear", "dense")
    attr_defaults: dict = {}

    def equation(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise OpError("bad-arity", f"op 'linear' takes 2 or 3 inputs [x, weight, bias?], got {len(inputs)}",
                          hint="give linear x, weight and optionally bias")
        x, w = inputs[:2]
        bad = []
        if x.ndim < 1:
            bad.append(_rank_violation("x", x, "linear needs x of rank >= 1 (..., in)", "reshape x to (..., in)"))
        if w.ndim != 2:
            bad.append(_rank_violation("weight", w, "linear takes a 2-D weight (out, in)",
                                       "give weight the shape (out, in), as torch.nn.Linear"))
        if len(inputs) == 3 and inputs[2].ndim != 1:
            bad.append(_rank_violation("bias", inputs[2], "linear takes a 1-D bias (out,)", "give bias the shape (out,)"))
        if x.ndim - 1 > len(BATCH_LETTERS):
            bad.append(_rank_violation("x", x, f"at most {len(BATCH_LETTERS)} batch dims are supported",
                                       "merge batch dims with a reshape"))
        if bad:
            return None, (), bad
        batch = BATCH_LETTERS[:x.ndim - 1]
        return Equation((batch + "i", "oi"), batch + "o"), (("o",) if len(inputs) == 3 else ()), []

    def localize(self, attrs, inputs, outputs, rank):
        out = dict(attrs)
        if len(inputs) == 3:
            coords = outputs[0].mesh.coords(rank)
            bias = inputs[2].layout
            once = [a for a, op in outputs[0].layout.partial_axes().items()
                    if op == "sum" and not bias.placements[a].is_partial()]
            out["add_bias"] = all(coords[a] == 0 for a in once)
        return out

    def additive_grads(self, g, inputs, cotangent, needs):
        if not needs or not needs[0] or cotangent is None:
            return (None,) * len(needs)
        dy_spec = g.spec(cotangent)
        grad = cotangent if dy_spec.ndim == 1 else g.op(
            "sum", [cotangent], {"dims": list(range(dy_spec.ndim - 1)), "keepdim": False})
        return (sum_to_shape(g, grad, g.spec(inputs[2]).shape),)


# ===================================================================== embedding
@dataclass(frozen=True)
class EmbeddingAxis:
    """The embedding rule's decision on one mesh axis.

    ``kind``: ``vocab`` (table rows sharded: output ``P(sum)``), ``hidden`` (table columns
    sharded: output last dim sharded), ``ids`` (ids dim ``ids_dim`` sharded), ``partial``
    (a partial table passes through), ``none``.
    """

    kind: str
    ids_target: Placement
    table_target: Placement
    output: Placement
    ids_dim: int | None = None


def _embedding_axis(axis: int, ids: TensorSpec, table: TensorSpec) -> EmbeddingAxis:
    i_p = ids.layout.placements[axis]
    t_p = table.layout.placements[axis]
    out_last = ids.ndim
    table_kinds = {0: "vocab", 1: "hidden"}
    options = []  # (cost, decision) in preference order: keep the table, then the ids, then nothing
    if isinstance(t_p, Shard):
        out = Partial("sum") if t_p.dim == 0 else Shard(out_last)
        options.append(EmbeddingAxis(table_kinds[t_p.dim], Replicate(), t_p, out))
    elif isinstance(t_p, Partial) and t_p.reduce_op in LINEAR_PARTIALS:
        options.append(EmbeddingAxis("partial", Replicate(), t_p, t_p))
    if isinstance(i_p, Shard):
        options.append(EmbeddingAxis("ids", i_p, Replicate(), Shard(i_p.dim), i_p.dim))
    options.append(EmbeddingAxis("none", Replicate(), Replicate(), Replicate()))

    def cost(d: EmbeddingAxis) -> int:
        return _move_cost(ids, axis, i_p, d.ids_target) + _move_cost(table, axis, t_p, d.table_target)

    return min(options, key=cost)  # min keeps the first of equal costs


def embedding_analysis(ids: TensorSpec, table: TensorSpec) -> tuple[list[EmbeddingAxis], list[Violation],
                                                                   tuple[Layout | None, Layout | None]]:
    """Per-axis decisions, violations and wants of ``embedding(ids, table)`` (shapes already valid).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> ids = TensorSpec((4, 6), "int64", Layout(mesh, ["S(0)", "R"], 2))
    >>> table = TensorSpec((10, 8), "float32", Layout(mesh, ["R", "S(0)"], 2))
    >>> [d.kind for d in embedding_analysis(ids, table)[0]]
    ['ids', 'vocab']
    """
    mesh = ids.mesh
    decisions = [_embedding_axis(a, ids, table) for a in range(mesh.ndim)]
    violations: list[Violation] = []
    values = f"ids is {ids.layout}, table is {table.layout}"
    wants = []
    for name, spec, attr in (("ids", ids, "ids_target"), ("table", table, "table_target")):
        want = Layout(mesh, [getattr(d, attr) for d in decisions], spec.ndim)
        wants.append(None if want == spec.layout else want)
        problems = []
        for axis, d in enumerate(decisions):
            have = spec.layout.placements[axis]
            if have == getattr(d, attr) or isinstance(have, Replicate):
                continue
            problems.append((axis, _embedding_problem(name, spec, have, axis, d, ids, table, values)))
        violations += _move_violations(spec, want, name, problems)
    return decisions, violations, (wants[0], wants[1])


def _embedding_problem(name, spec, have, axis, d: EmbeddingAxis, ids, table, values) -> tuple[str, str, str]:
    ax = _axis(spec.mesh, axis)
    reduce = f"reduce {name} on {ax} first"
    if name == "ids" and isinstance(have, Partial):
        return ("partial-input", f"ids is {have} on mesh axis {ax}; ids are indices, and a partial sum of indices "
                f"cannot be looked up term by term ({values})", reduce)
    if name == "table" and isinstance(have, Partial) and have.reduce_op not in LINEAR_PARTIALS:
        return ("partial-input", f"table is {have} on mesh axis {ax}; embedding passes P(sum) and P(avg) of the "
                f"table through, not {have} ({values})", reduce)
    t_p = table.layout.placements[axis]
    table_desc = {0: f"table dim 0 (vocab, size {table.shape[0]}) is sharded on mesh axis {ax} (vocab-parallel)",
                  1: f"table dim 1 (hidden, size {table.shape[1]}) is sharded on mesh axis {ax}"}
    if name == "ids":
        what = table_desc[t_p.dim] if isinstance(t_p, Shard) else f"table is {t_p} on {ax}"
        return ("sharding-mismatch", f"ids dim {have.dim} (size {ids.shape[have.dim]}) is sharded on mesh axis {ax} "
                f"but {what}; a rank holding part of the ids and part of the table cannot look them up ({values})",
                f"all-gather ids on {ax} (--reshard does: the table is at least as large), or keep the table "
                f"Replicate on {ax}")
    i_p = ids.layout.placements[axis]
    if isinstance(have, Partial):
        return ("partial-input", f"table is {have} on mesh axis {ax} while ids dim {i_p.dim} (size "
                f"{ids.shape[i_p.dim]}) is sharded there; a partial table passes through only with Replicate ids "
                f"({values})", reduce + " (cheaper than gathering the ids), or all-gather ids on " + ax)
    return ("sharding-mismatch", f"{table_desc[have.dim]} but ids dim {i_p.dim} (size {ids.shape[i_p.dim]}) is sharded "
            f"there too; a rank holding part of the ids and part of the table cannot look them up ({values})",
            f"all-gather the table on {ax} (--reshard does: the ids are larger), or keep ids "
            f"Replicate on {ax}")


def _embedding_shape_violations(ids: TensorSpec, table: TensorSpec) -> list[Violation]:
    out = []
    if not np.issubdtype(np.dtype(ids.dtype), np.integer):
        out.append(Violation("invalid-dtype", f"ids has dtype {ids.dtype}; embedding looks up integer ids",
                             "give ids the dtype int32 or int64", operand="ids"))
    if table.ndim != 2:
        out.append(_rank_violation("table", table, "embedding takes a 2-D table (vocab, hidden)",
                                   "give the table the shape (vocab, hidden)"))
    return out


@register_op
class Embedding(OpRule):
    """``embedding(ids, table)``: rows of ``table`` at ``ids``; out-of-range ids give zeros.

    Examples
    --------
    Vocabulary-parallel table: each rank looks up its own rows, the output is a partial sum.

    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> ids = TensorSpec((4, 6), "int64", Layout(mesh, ["R"], 2))
    >>> table = TensorSpec((10, 8), "float32", Layout(mesh, ["S(0)"], 2))
    >>> res = Embedding().infer_layout((ids, table), {})
    >>> str(res.outputs[0]), [Embedding().localize({}, (ids, table), res.outputs, r) for r in range(2)]
    ('float32[4, 6, 8] (P(sum))', [{'vocab_start': 0}, {'vocab_start': 5}])
    """

    name = "embedding"
    operands = ("ids", "table")
    aliases = ("Embedding",)
    attr_defaults: dict = {}
    violation_codes = EMBEDDING_CODES

    def infer_layout(self, inputs, attrs):
        ids, table = inputs
        bad = _embedding_shape_violations(ids, table)
        if bad:
            return _no_outputs(bad)
        decisions, violations, wants = embedding_analysis(ids, table)
        out = TensorSpec(ids.shape + (table.shape[1],), table.dtype,
                         Layout(ids.mesh, [d.output for d in decisions], ids.ndim + 1))
        return RuleResult((out,), tuple(violations), wants)

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, "vocab_start": inputs[1].local_slices(rank)[0][0]}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None or not needs[1]:
            return (None, None)
        ids, table = g.spec(inputs[0]), g.spec(inputs[1])
        decisions, _, _ = embedding_analysis(ids, table)
        placements = [str(d.table_target) if not isinstance(d.table_target, Partial) else "R" for d in decisions]
        grad = g.op("embedding_grad", [dy, inputs[0]], {"num_embeddings": table.shape[0],
                                                         "table_placements": placements})
        return (None, grad)  # ids are indices: no gradient


@register_op
class EmbeddingGrad(OpRule):
    """``embedding_grad(dy, ids, num_embeddings, table_placements)``: scatter-add ``dy`` at ``ids``.

    ``table_placements`` is the layout the forward looked the ids up in (never Partial);
    the gradient is vocabulary-sharded or hidden-sharded like that table, and ``P(sum)``
    where the ids are sharded.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> dy = TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)"], 3))
    >>> ids = TensorSpec((4, 6), "int64", Layout(mesh, ["S(0)"], 2))
    >>> res = EmbeddingGrad().infer_layout((dy, ids), {"num_embeddings": 10, "table_placements": ["R"]})
    >>> str(res.outputs[0])
    'float32[10, 8] (P(sum))'
    """

    name = "embedding_grad"
    operands = ("dy", "ids")
    aliases = ("EmbeddingGrad",)
    attr_defaults = {"num_embeddings": None, "table_placements": None}
    violation_codes = EMBEDDING_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, ids = inputs
        vocab = attrs.get("num_embeddings")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0:
            raise OpError("bad-attr", f"embedding_grad: num_embeddings must be the table's vocabulary size, got "
                          f"{vocab!r}", hint="give num_embeddings as a non-negative integer")
        bad = []
        if dy.shape[:-1] != ids.shape or dy.ndim != ids.ndim + 1:
            bad.append(Violation("broadcast-shape", f"dy has shape {list(dy.shape)} but ids {list(ids.shape)}; the "
                                 "cotangent of an embedding has the shape ids.shape + (hidden,)",
                                 "give dy the embedding output's shape", operand="dy"))
        if bad:
            return _no_outputs(bad)
        hidden = dy.shape[-1]
        placements = attrs.get("table_placements") or ["R"] * dy.mesh.ndim
        table = TensorSpec((vocab, hidden), dy.dtype, Layout(dy.mesh, placements, 2))
        bad = _embedding_shape_violations(ids, table)
        if bad:
            return _no_outputs(bad)
        decisions, found, (ids_want, _) = embedding_analysis(ids, table)
        violations = [v for v in found if v.operand == "ids"]
        grad_ps = {"vocab": lambda d: Shard(0), "hidden": lambda d: Shard(1), "ids": lambda d: Partial("sum")}
        out_ps = [grad_ps.get(d.kind, lambda d: Replicate())(d) for d in decisions]
        dy_want = Layout(dy.mesh, [d.output if not isinstance(d.output, Partial) else Replicate()
                                   for d in decisions], dy.ndim)
        violations += _move_violations(
            dy, dy_want, "dy",
            [(a, ("sharding-mismatch", f"dy is {dy.layout.placements[a]} on mesh axis {_axis(dy.mesh, a)} but the "
                  f"embedding output was {decisions[a].output} there (ids is {ids.layout}, table placements "
                  f"{list(placements)})", "give the cotangent the output's layout (Partial axes Replicate)"))
             for a in range(dy.mesh.ndim) if dy.layout.placements[a] != dy_want.placements[a]
             and not isinstance(dy.layout.placements[a], Replicate)])
        out = TensorSpec((vocab, hidden), dy.dtype, Layout(dy.mesh, out_ps, 2))
        return RuleResult((out,), tuple(violations), (None if dy_want == dy.layout else dy_want, ids_want))

    def localize(self, attrs, inputs, outputs, rank):
        start, stop = outputs[0].local_slices(rank)[0]
        return {**attrs, "num_embeddings": stop - start, "vocab_start": start}


# ===================================================================== reductions
def normalize_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    """Sorted non-negative reduced dims; ``None`` means every dim.  Raises ``ValueError``.

    Examples
    --------
    >>> normalize_dims(None, 3), normalize_dims(-1, 3), normalize_dims([2, 0], 3), normalize_dims([], 3)
    ((0, 1, 2), (2,), (0, 2), ())
    >>> normalize_dims([0, -3], 3)
    Traceback (most recent call last):
    ...
    ValueError: dims [0, -3] name dim 0 twice
    """
    if dims is None:
        return tuple(range(ndim))
    items = [dims] if isinstance(dims, int) and not isinstance(dims, bool) else dims
    if not isinstance(items, (list, tuple)) or any(isinstance(d, bool) or not isinstance(d, int) for d in items):
        raise ValueError(f"dims must be an int, a list of ints or null, got {dims!r}")
    out = []
    for d in items:
        if not -ndim <= d < ndim:
            raise ValueError(f"dim {d} is out of range for a tensor of rank {ndim}")
        if d % ndim in out:
            raise ValueError(f"dims {list(items)} name dim {d % ndim} twice")
        out.append(d % ndim)
    return tuple(sorted(out))


def _reduced_shape(shape, dims, keepdim) -> tuple[int, ...]:
    return tuple(1 if d in dims else n for d, n in enumerate(shape) if keepdim or d not in dims)


def _kept_dim(dim: int, dims: tuple[int, ...], keepdim: bool) -> int:
    return dim if keepdim else dim - sum(1 for r in dims if r < dim)


class ReduceRule(OpRule):
    """Shared rule of ``sum``, ``mean``, ``max``; subclasses set ``shard_partial`` (what a
    sharded reduced dim leaves) and ``passes`` (the Partial ops that pass through)."""

    operands = ("x",)
    attr_defaults = {"dims": None, "keepdim": False}
    violation_codes = REDUCE_CODES
    strided = True  # a reduced strided dim leaves the Partial a shard leaves; a kept one stays strided
    shard_partial = "sum"
    passes: tuple[str, ...] = LINEAR_PARTIALS
    linear_words = "linear"

    def out_dtype(self, x: TensorSpec) -> str:
        return x.dtype

    def infer_layout(self, inputs, attrs):
        (x,) = inputs
        try:
            dims = normalize_dims(attrs.get("dims"), x.ndim)
        except ValueError as err:
            return _no_outputs([Violation("invalid-dims", f"{self.name}: {err}",
                                          f"give dims in {-x.ndim}..{x.ndim - 1}, each once, or null for all",
                                          operand="x")])
        keepdim = bool(attrs.get("keepdim"))
        out_ps, want_ps, problems = [], [], []
        for axis, p in enumerate(x.layout.placements):
            if isinstance(p, Shard):
                out_ps.append(Partial(self.shard_partial) if p.dim in dims else Shard(_kept_dim(p.dim, dims, keepdim)))
                want_ps.append(p)
            elif isinstance(p, StridedShard):  # a strided shard is a shard for a reduction too
                out_ps.append(Partial(self.shard_partial) if p.dim in dims else
                              StridedShard(_kept_dim(p.dim, dims, keepdim), p.split_factor))
                want_ps.append(p)
            elif isinstance(p, Partial) and p.reduce_op not in self.passes:
                out_ps.append(Replicate())
                want_ps.append(Replicate())
                ax = _axis(x.mesh, axis)
                allowed = " and ".join(f"P({op})" for op in self.passes)
                problems.append((axis, (
                    "partial-input", f"x is {p} on mesh axis {ax}; {self.name} over dims {list(dims)} passes only "
                    f"{allowed} through ({self.linear_words}), so a {p} x must be reduced first (x is {x.layout})",
                    f"reduce x on {ax} first (all-reduce {p.reduce_op}), or apply {self.name} before the partial "
                    "value is formed")))
            else:
                out_ps.append(p)
                want_ps.append(p)
        want = Layout(x.mesh, want_ps, x.ndim)
        shape = _reduced_shape(x.shape, dims, keepdim)
        out = TensorSpec(shape, self.out_dtype(x), Layout(x.mesh, out_ps, len(shape)))
        violations = _move_violations(x, want, "x", problems)
        return RuleResult((out,), tuple(violations), (None if want == x.layout else want,))

    def _grad_placements(self, g, x: str) -> list[str]:
        """x's placements for the gradient, Partial and strided axes Replicate (the forward
        reduced and gathered those, and the grad op takes no strided shard)."""
        return ["R" if p.is_partial() or isinstance(p, StridedShard) else str(p)
                for p in g.spec(x).layout.placements]


@register_op
class ReduceSum(ReduceRule):
    """``sum(x, dims=None, keepdim=False)``; a sharded reduced dim gives ``P(sum)``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2, 2), ("dp", "tp"))
    >>> x = TensorSpec((4, 6, 8), "float32", Layout(mesh, ["S(0)", "S(2)"], 3))
    >>> str(ReduceSum().infer_layout((x,), {"dims": [0, 1]}).outputs[0])
    'float32[8] (P(sum), S(0))'
    """

    name = "sum"
    aliases = ("ReduceSum", "aten.sum", "reduce_sum")

    def out_dtype(self, x):
        return "int64" if x.dtype == "bool" else x.dtype

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        return (self._broadcast_back(g, inputs[0], cotangents[0], attrs, 1.0),)

    def _broadcast_back(self, g, x: str, dy: str | None, attrs, scale: float) -> str | None:
        if dy is None:
            return None
        spec = g.spec(x)
        dims = list(normalize_dims(attrs.get("dims"), spec.ndim))
        return g.op("sum_grad", [dy], {"shape": list(spec.shape), "dims": dims, "keepdim": bool(attrs.get("keepdim")),
                                       "scale": scale, "placements": self._grad_placements(g, x)})


@register_op
class ReduceMean(ReduceSum):
    """``mean(x, dims=None, keepdim=False)``; a sharded reduced dim gives ``P(sum)`` of local
    sums scaled by one over the global count (exact under uneven shards).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((4,), ("sp",))
    >>> x = TensorSpec((10, 3), "float32", Layout(mesh, ["S(0)"], 2))
    >>> res = ReduceMean().infer_layout((x,), {"dims": [0]})
    >>> str(res.outputs[0]), ReduceMean().localize({"dims": [0]}, (x,), res.outputs, 3)["count"]
    ('float32[3] (P(sum))', 10)
    """

    name = "mean"
    aliases = ("ReduceMean", "aten.mean", "reduce_mean")

    def out_dtype(self, x):
        return x.dtype if is_float_dtype(numpy_dtype(x.dtype)) else "float32"

    def localize(self, attrs, inputs, outputs, rank):
        dims = normalize_dims(attrs.get("dims"), inputs[0].ndim)
        return {**attrs, "count": int(math.prod(inputs[0].shape[d] for d in dims))}

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        spec = g.spec(inputs[0])
        count = math.prod(spec.shape[d] for d in normalize_dims(attrs.get("dims"), spec.ndim))
        return (self._broadcast_back(g, inputs[0], cotangents[0], attrs, 1.0 / count if count else 0.0),)


@register_op
class ReduceMax(ReduceRule):
    """``max(x, dims=None, keepdim=False)`` (``amax``); a sharded reduced dim gives ``P(max)``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["P(sum)"], 2))
    >>> [v.code for v in ReduceMax().infer_layout((x,), {"dims": [1]}).violations]
    ['partial-input']
    """

    name = "max"
    aliases = ("ReduceMax", "aten.amax", "reduce_max", "amax")
    shard_partial = "max"
    passes = ("max",)
    linear_words = "the max of maxima is the max, but the max of a sum is not the sum of maxima"

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        if cotangents[0] is None:
            return (None,)
        spec = g.spec(inputs[0])
        dims = list(normalize_dims(attrs.get("dims"), spec.ndim))
        return (g.op("max_grad", [cotangents[0], inputs[0], outputs[0]],
                     {"dims": dims, "keepdim": bool(attrs.get("keepdim"))}),)


def _reduced_image(layout: Layout, dims: tuple[int, ...], keepdim: bool, ndim_out: int) -> Layout:
    """Where a value of ``layout`` lands after reducing ``dims``, Partial axes Replicate."""
    ps = []
    for p in layout.placements:
        if isinstance(p, Shard) and p.dim not in dims:
            ps.append(Shard(_kept_dim(p.dim, dims, keepdim)))
        else:
            ps.append(Replicate())
    return Layout(layout.mesh, ps, ndim_out)


def _cotangent_problems(name: str, spec: TensorSpec, want: Layout, why: str) -> list[tuple[int, tuple[str, str, str]]]:
    out = []
    for a, (have, target) in enumerate(zip(spec.layout.placements, want.placements)):
        if have != target and not isinstance(have, Replicate):
            ax = _axis(spec.mesh, a)
            code = "partial-input" if isinstance(have, Partial) else "sharding-mismatch"
            out.append((a, (code, f"{name} is {have} on mesh axis {ax} but {why} needs {target} there "
                            f"({name} is {spec.layout}, wanted {want})", f"give {name} the layout {want}")))
    return out


@register_op
class SumGrad(OpRule):
    """``sum_grad(dy, shape, dims, keepdim, scale, placements)``: ``dy`` broadcast back over the
    reduced dims into ``placements`` (x's layout, Partial axes Replicate), times ``scale``.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("sp",))
    >>> dy = TensorSpec((3,), "float32", Layout(mesh, ["R"], 1))
    >>> attrs = {"shape": [5, 3], "dims": [0], "keepdim": False, "scale": 0.2, "placements": ["S(0)"]}
    >>> res = SumGrad().infer_layout((dy,), attrs)
    >>> str(res.outputs[0]), SumGrad().localize(attrs, (dy,), res.outputs, 1)["shape"]
    ('float32[5, 3] (S(0))', [2, 3])
    """

    name = "sum_grad"
    operands = ("dy",)
    attr_defaults = {"shape": None, "dims": None, "keepdim": False, "scale": 1.0, "placements": None}
    required_attrs = ("shape",)
    violation_codes = REDUCE_GRAD_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        (dy,) = inputs
        shape = tuple(attrs["shape"])
        try:
            dims = normalize_dims(attrs.get("dims"), len(shape))
        except ValueError as err:
            return _no_outputs([Violation("invalid-dims", f"sum_grad: {err}", "give the forward's dims",
                                          operand="dy")])
        keepdim = bool(attrs.get("keepdim"))
        if _reduced_shape(shape, dims, keepdim) != dy.shape:
            return _no_outputs([Violation("broadcast-shape", f"dy has shape {list(dy.shape)} but reducing "
                                          f"{list(shape)} over {list(dims)} gives "
                                          f"{list(_reduced_shape(shape, dims, keepdim))}",
                                          "give dy the reduction's output shape", operand="dy")])
        layout = Layout(dy.mesh, attrs.get("placements") or ["R"] * dy.mesh.ndim, len(shape))
        want = _reduced_image(layout, dims, keepdim, dy.ndim)
        violations = _move_violations(dy, want, "dy", _cotangent_problems("dy", dy, want, f"a gradient in {layout}"))
        return RuleResult((TensorSpec(shape, dy.dtype, layout),), tuple(violations),
                          (None if want == dy.layout else want,))

    def localize(self, attrs, inputs, outputs, rank):
        return {**attrs, "shape": list(outputs[0].local_shape(rank))}


@register_op
class MaxGrad(OpRule):
    """``max_grad(dy, x, y, dims, keepdim)``: the cotangent to every element of ``x`` equal to
    the maximum ``y`` (ties: each gets the whole cotangent); ``dx`` in x's layout.

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((4, 6), "float32", Layout(mesh, ["S(1)"], 2))
    >>> y = TensorSpec((4,), "float32", Layout(mesh, ["P(max)"], 1))
    >>> dy = TensorSpec((4,), "float32", Layout(mesh, ["R"], 1))
    >>> res = MaxGrad().infer_layout((dy, x, y), {"dims": [1]})
    >>> str(res.outputs[0].layout), [v.code for v in res.violations], str(res.wants[2])
    ('(S(1))', ['partial-input'], '(R)')
    """

    name = "max_grad"
    operands = ("dy", "x", "y")
    attr_defaults = {"dims": None, "keepdim": False}
    violation_codes = REDUCE_GRAD_CODES
    differentiable = False

    def infer_layout(self, inputs, attrs):
        dy, x, y = inputs
        try:
            dims = normalize_dims(attrs.get("dims"), x.ndim)
        except ValueError as err:
            return _no_outputs([Violation("invalid-dims", f"max_grad: {err}", "give the forward's dims",
                                          operand="x")])
        keepdim = bool(attrs.get("keepdim"))
        reduced = _reduced_shape(x.shape, dims, keepdim)
        bad = [Violation("broadcast-shape", f"{n} has shape {list(t.shape)} but max of x {list(x.shape)} over "
                         f"{list(dims)} has shape {list(reduced)}", f"give {n} the max's output shape", operand=n)
               for n, t in (("dy", dy), ("y", y)) if t.shape != reduced]
        if bad:
            return _no_outputs(bad)
        x_want = Layout(x.mesh, [Replicate() if p.is_partial() else p for p in x.layout.placements], x.ndim)
        x_problems = [(a, ("partial-input", f"x is {p} on mesh axis {_axis(x.mesh, a)}; the gradient of max "
                           "compares every element of x with the maximum, so it needs x's values, not partial terms "
                           f"(x is {x.layout})", f"reduce x on {_axis(x.mesh, a)} first (all-reduce {p.reduce_op})"))
                      for a, p in enumerate(x.layout.placements) if p.is_partial()]
        image = _reduced_image(x_want, dims, keepdim, len(reduced))
        violations = _move_violations(x, x_want, "x", x_problems)
        for name, t in (("dy", dy), ("y", y)):
            why = "the maximum of x" if name == "y" else f"the gradient of x in {x_want}"
            violations += _move_violations(t, image, name, _cotangent_problems(name, t, image, why))
        wants = (None if image == dy.layout else image, None if x_want == x.layout else x_want,
                 None if image == y.layout else image)
        return RuleResult((TensorSpec(x.shape, dy.dtype, x_want),), tuple(violations), wants)
