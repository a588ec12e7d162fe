"""The op registry: a rule object per op, registered with a decorator beside its definition.

A rule's :meth:`OpRule.infer_layout` is a pure function of the input specs and the attrs.
It returns a :class:`RuleResult`: the output specs, the violations, and ``wants``: for
each input, the layout the local kernel needs (``None`` when the input is fine as is).
A want whose redistribution is free (``local-slice``) is applied by lowering without
complaint; any other want comes with a violation, and ``--reshard`` fulfils it by
inserting a redistribution node.

Examples
--------
>>> get_rule("npu_rotary_mul").name
'rotary_position_embedding'
>>> get_rule("rotary_embeding")
Traceback (most recent call last):
...
layout_prop.core.errors.OpError: unknown-op: unknown op 'rotary_embeding' (hint: did you mean 'rotary_position_embedding'?)
"""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, field
from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence

from .errors import GraphError, LayoutPropError, OpError, Violation, cut, describe
from .layout import Layout
from .spec import TensorSpec

__all__ = ["OpSample", "OpRule", "RuleResult", "register_op", "get_rule", "is_registered", "registered_ops",
           "variadic_output_ops", "InputDomain", "GradBuilder",
           "ExpandBuilder", "apply_rule", "ATTR_KINDS", "attr_type", "check_attr_type"]

_RULES: dict[str, "OpRule"] = {}
_ALIASES: dict[str, str] = {}


@dataclass(frozen=True)
class RuleResult:
    """What a transfer function returns.

    ``outputs`` may hold ``None`` for an output the rule cannot describe (its inputs are
    unusable); downstream nodes of such a value are skipped, the violation already says why.
    """

    outputs: tuple[TensorSpec | None, ...]
    violations: tuple[Violation, ...] = ()
    wants: tuple[Layout | None, ...] = ()


class GradBuilder(Protocol):
    """What a vjp rule uses to add backward nodes to the graph (the backward pass supplies it)."""

    def op(self, op: str, inputs: Sequence[str], attrs: dict | None = None,
           num_outputs: int = 1) -> str | tuple[str, ...]:
        ...

    def spec(self, value: str) -> TensorSpec:
        ...


class ExpandBuilder(Protocol):
    """What an :meth:`OpRule.expand` hook uses to write its subgraph (the expand pass supplies it).

    ``op`` adds an intermediate node named ``NODE/name`` (``name`` defaults to the op's name) and
    returns its value(s); ``result`` adds the last node, named like the node it replaces and with
    as many outputs, so that consumers and graph outputs read it unchanged.  Both propagate at
    once; ``spec`` is the spec of any value the subgraph reads or made.
    """

    def op(self, op: str, inputs: Sequence[str], attrs: dict | None = None, num_outputs: int = 1,
           name: str | None = None) -> str | tuple[str, ...]:
        ...

    def result(self, op: str, inputs: Sequence[str], attrs: dict | None = None) -> str | tuple[str, ...]:
        ...

    def spec(self, value: str) -> TensorSpec:
        ...

    def force(self, reason: str) -> None:
        """Keep the expansion even where it moves no fewer bytes (the node's attrs ask for it)."""

    def note(self, text: str) -> None:
        """Add a note of the expand pass."""


class OpRule(ABC):
    """Base class of op rules.

    Subclasses set ``name``, ``operands`` (parameter names), optional ``aliases``,
    ``num_outputs``, ``attr_defaults``, and implement :meth:`infer_layout`; ops with a
    gradient implement :meth:`vjp`.
    """

    name: str = ""
    operands: tuple[str, ...] = ()
    variadic: bool = False  # any number of inputs past ``operands`` (concat, einsum)
    optional_operands: tuple[str, ...] = ()  # trailing operands that may be left out (linear's bias)
    aliases: tuple[str, ...] = ()
    num_outputs: int = 1
    attr_defaults: dict[str, Any] = {}
    #: the type of an attr, as ``ATTR_KINDS`` names joined by ``|`` (``"int | list[int] | None"``), checked
    #: before infer_layout; an attr not named here is checked permissively (see ``attr_type``)
    attr_types: dict[str, str] = {}
    differentiable: bool = True
    violation_codes: tuple[str, ...] = ()  # every code infer_layout may report (the testing kit checks)
    required_attrs: tuple[str, ...] = ()  # attrs without a usable default: missing or null is bad-attr
    strided: bool = False  # infer_layout takes strided shards; else apply_rule gathers them first
    #: the output count follows the attrs and the input shapes (torch's ``unbind``, ``chunk``, ``split``): a node's
    #: count is :meth:`output_count`, worked out when the graph is built; ``num_outputs`` is then only a default
    variadic_outputs: bool = False
    #: the step model's cost class of the op (``vector``, ``matmul``, ``attention`` or ``free``; perf/costs.py's
    #: tables name the built-in ops) and, for ``vector``, the FLOPs an output element costs: a new family
    #: declares them beside its rule (None: the op is priced nowhere, which ``estimate`` reports)
    cost_kind: str | None = None
    vector_flops: int = 1

    # ---------------------------------------------------------------- attrs and arity
    def normalize_attrs(self, attrs: dict, node: str | None = None) -> dict:
        """Fill defaults, reject unknown attributes (``bad-attr``) and values of the wrong type (``bad-value``,
        at ``attrs.NAME``: see :func:`check_attr_type`)."""
        unknown = sorted(set(attrs) - set(self.attr_defaults))
        if unknown:
            raise OpError("bad-attr", f"op {self.name!r} has no attribute(s) {unknown}", node=node,
                          hint=f"known attributes: {sorted(self.attr_defaults) or 'none'}")
        out = dict(self.attr_defaults)
        out.update(attrs)
        for name, value in attrs.items():
            check_attr_type(self, name, value, node)
        missing = [name for name in self.required_attrs if out.get(name) is None]
        if missing:
            raise OpError("bad-attr", f"op {self.name!r} needs attribute(s) {missing}", node=node,
                          hint=f"give {', '.join(missing)} in the node's attrs")
        return out

    def arity(self) -> tuple[int, int | None]:
        """The least and the most inputs the op takes (None: no limit)."""
        if self.variadic:
            return len(self.operands), None
        return len(self.operands), len(self.operands) + len(self.optional_operands)

    def arity_text(self) -> str:
        """``3 inputs [x, cos, sin]``, ``2 or 3 inputs [x, weight, bias?]``, ``at least 1 input [x, ...]``."""
        low, high = self.arity()
        names = list(self.operands) + [f"{o}?" for o in self.optional_operands]
        listed = f"[{', '.join(names)}{', ...' if self.variadic else ''}]"
        count = f"at least {low}" if high is None else str(low) if low == high else f"{low} to {high}" if \
            high - low > 1 else f"{low} or {high}"
        plural = "input" if (high or low) == 1 and low == 1 else "inputs"
        return f"{count} {plural} {listed}"

    def check_arity(self, node) -> None:
        n = len(node.inputs)
        low, high = self.arity()
        if n < low or (high is not None and n > high):
            raise GraphError("bad-arity", f"op {self.name!r} takes {self.arity_text()}, got {n}",
                             node=node.name, hint=f"give {self.name} its operands {self.arity_text()}")
        if node.num_outputs != self.num_outputs and not self.variadic_outputs:
            raise GraphError("bad-arity", f"op {self.name!r} has {self.num_outputs} outputs, node says "
                             f"{node.num_outputs}", node=node.name, hint="build nodes through Graph.op")

    def output_count(self, attrs: dict, shapes: tuple[tuple[int, ...], ...]) -> int:
        """How many outputs a node of this op has, given its normalized attrs and its inputs' shapes.

        ``num_outputs`` unless the rule sets ``variadic_outputs``: then the count follows the
        attrs and shapes (``unbind``: the size of ``dim``), and attrs that give no count raise
        the rule's :class:`~layout_prop.core.errors.OpError` (the graph builder reports it at
        the node).  Pure; asked when a node is built (:func:`layout_prop.core.graph.output_counts`).

        >>> get_rule("unbind").output_count({"dim": 1}, ((4, 3),)), get_rule("topk").output_count({}, ((4,),))
        (3, 2)
        """
        return self.num_outputs

    def operand_name(self, index: int) -> str:
        names = self.operands + self.optional_operands
        if index < len(names):
            return names[index]
        return f"{self.operands[-1] if self.operands else 'input'}{index}"

    # ---------------------------------------------------------------- the rules
    @abstractmethod
    def infer_layout(self, inputs: tuple[TensorSpec, ...], attrs: dict) -> RuleResult:
        """Output specs, violations and wanted input layouts. Pure."""

    def infer_source_layout(self, mesh, attrs: dict) -> RuleResult:
        """The outputs of a node with no inputs (a constant, a fill), on ``mesh``. Pure.

        The default describes none: such a node's values are reported as ``no-layout``
        (propagation stops there), never left out silently.
        """
        return RuleResult((None,) * self.num_outputs)

    def check_kernel(self, backend: str, local_shapes: tuple, inputs: tuple[TensorSpec, ...],
                     attrs: dict) -> list[Violation]:
        """Violations of ``backend``'s kernel limits for one rank's local input shapes (default none)."""
        return []

    def sample_inputs(self) -> list:
        """Sample operand shapes (``layout_prop.testing.OpSample``) the testing kit tries by default."""
        return []

    def localize(self, attrs: dict, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                 rank: int) -> dict:
        """The attrs rank ``rank``'s local kernel gets (a reshape target, a mask offset...).

        ``inputs`` are the specs the kernel sees (after free local slices).
        """
        return dict(attrs)

    def input_scale(self, index: int, inputs: tuple[TensorSpec, ...], attrs: dict) -> float:
        """The standard deviation random test data for input ``index`` should have (default 1).

        ``layout-prop run`` draws a float graph input with the smallest scale its consumers
        ask for.  Products ask 1/sqrt(fan-in) for their weight operands, as a model is
        initialised, so that activations stay of order one: with unit weights a Transformer
        block saturates its softmax, and its gradients (near zero, float32 subnormals) then
        check little and compute slowly.
        """
        return 1.0

    def input_domain(self, index: int, inputs: tuple[TensorSpec, ...], attrs: dict) -> "InputDomain | None":
        """The values input ``index`` must hold for the op to run (default None: any value).

        ``layout-prop run`` draws a graph input from the domains its consumers declare: an index
        into a dim of size n asks ``InputDomain(0, n)``, multinomial's weights a positive range.
        """
        return None

    def vjp(self, g: GradBuilder, inputs: tuple[str, ...], outputs: tuple[str, ...],
            cotangents: tuple[str | None, ...], attrs: dict, needs: tuple[bool, ...]) -> tuple[str | None, ...]:
        """Add the nodes computing input cotangents; one value (or None) per input."""
        raise OpError("no-vjp", f"op {self.name!r} has no gradient rule",
                      hint="mark its inputs requires_grad: false, or register a vjp for the op")

    def expand(self, b: ExpandBuilder, inputs: tuple[str, ...], attrs: dict,
               specs: tuple[TensorSpec, ...]) -> str | tuple[str, ...] | None:
        """A subgraph of other ops computing this node on ``specs`` without moving its big input
        (default None: the node stays as it is).

        Asked by the expand pass (``check --reshard``, ``run``) for a node whose rule asks a move;
        it returns ``b.result(...)`` after writing the subgraph with ``b``, or None where it has no
        better form for these layouts (the input is not sharded where the plain rule moves it).
        The pass keeps the subgraph only when its own moves cost fewer bytes per rank than the
        plain rule's, and the result must have the node's output shapes and dtypes.
        """
        return None

    def comm_steps(self, attrs: dict, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> tuple:
        """The communication steps that ARE this op on these specs (default none: a kernel runs).

        An op that is a move of data between ranks (``ring_shift``: a cyclic ``permute``) returns
        its :class:`~layout_prop.core.redistribute.Step` s here: lowering runs them instead of a
        kernel, ``check`` lists them among the moves and the step model prices them as collectives.
        """
        return ()

    @property
    def is_communication(self) -> bool:
        """Whether the op is a move of data itself: its rule defines :meth:`comm_steps`."""
        return type(self).comm_steps is not OpRule.comm_steps


@dataclass(frozen=True)
class InputDomain:
    """The values an op takes for one operand: ``[low, high)``, integers for an integer dtype and
    uniform floats for a float one (see :meth:`OpRule.input_domain`).

    >>> InputDomain(0, 5).meet(InputDomain(1, 8))
    InputDomain(low=1, high=5)
    """

    low: float
    high: float

    def meet(self, other: "InputDomain") -> "InputDomain":
        """The values both domains take (an empty one when they do not overlap: ``high <= low``)."""
        return InputDomain(max(self.low, other.low), min(self.high, other.high))


# ------------------------------------------------------------------------------ attr types
def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_float(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # (eps: 1 is a float given as an int)


def _is_bool(value: Any) -> bool:
    if isinstance(value, bool) or (_is_int(value) and value in (0, 1)):  # (ONNX writes flags as 0 and 1)
        return True
    dtype = getattr(value, "dtype", None)  # a numpy bool scalar (core does not import numpy)
    return getattr(dtype, "kind", None) == "b" and getattr(value, "shape", None) == ()


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (numbers.Number, str)) or _is_bool(value)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _list_of(item) -> Any:
    def check(value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(map(item, value))

    return check


#: the attr types a rule may name in ``attr_types`` (``a | b`` accepts either): each one's test and
#: how a message says it
ATTR_KINDS = {
    "int": (_is_int, "an int"),
    "float": (_is_float, "a number"),
    "bool": (_is_bool, "a bool"),
    "str": (_is_str, "a string"),
    "scalar": (_is_scalar, "one value (a number, a bool, a string or null)"),
    "list": (_is_list, "a list"),
    "list[int]": (_list_of(_is_int), "a list of ints"),
    "list[float]": (_list_of(_is_float), "a list of numbers"),
    "list[str]": (_list_of(_is_str), "a list of strings"),
    "dict": (lambda value: isinstance(value, dict), "a mapping"),
    "None": (lambda value: value is None, "null"),
    "any": (lambda value: True, "anything"),
}


def attr_type(rule: OpRule, name: str) -> str:
    """The type of attr ``name`` of ``rule``: declared in ``attr_types``, else read off its default.

    An attr a rule declares nothing for is checked permissively, so that the rule still
    judges the values it knows (``mode: 1.5``, ``factor: "two"``, ``causal: 1``: its own
    violations): one value (``scalar``) where the default is a number, a bool or a string,
    and anything where it is None or a list.  Only a list or a mapping where one value
    belongs is refused before the rule (it made rules raise: ``mode: [1, 1]``).

    >>> rule = get_rule("rotary_position_embedding")
    >>> attr_type(rule, "mode"), attr_type(rule, "input_layout")
    ('scalar', 'any')
    """
    declared = rule.attr_types.get(name)
    if declared is not None:
        return declared
    default = rule.attr_defaults.get(name)
    return "scalar" if _is_scalar(default) and default is not None else "any"


#: the rule class -> {attr: (its type as written, its tests)}, worked out on the first check
_ATTR_CHECKS: dict[type, dict[str, tuple[str, tuple]]] = {}


def _attr_checks(rule: OpRule) -> dict[str, tuple[str, tuple]]:
    checks = _ATTR_CHECKS.get(type(rule))
    if checks is None:
        checks = {}
        for name in set(rule.attr_defaults) | set(rule.attr_types):
            kinds = [kind.strip() for kind in attr_type(rule, name).split("|")]
            unknown = [kind for kind in kinds if kind not in ATTR_KINDS]
            if unknown:
                raise OpError("bad-rule", f"op {rule.name!r} declares attr {name!r} of unknown type(s) {unknown}",
                              hint=f"attr_types names types from {sorted(ATTR_KINDS)}, joined by '|'")
            if "any" not in kinds:
                checks[name] = (" or ".join(ATTR_KINDS[kind][1] for kind in kinds),
                                tuple(ATTR_KINDS[kind][0] for kind in kinds))
        _ATTR_CHECKS[type(rule)] = checks
    return checks


def check_attr_type(rule: OpRule, name: str, value: Any, node: str | None = None) -> None:
    """``bad-value`` at ``attrs.NAME`` unless ``value`` has the type of ``rule``'s attr ``name``.

    Run by :meth:`OpRule.normalize_attrs` before any rule sees the attrs, so that a value of the
    wrong type (a list for a mode) is the spec's mistake, not a rule that failed.  Ints are
    floats, 0 and 1 are booleans and tuples are lists (see :func:`attr_type` for an attr whose
    rule declares no type).

    >>> rule = get_rule("rotary_position_embedding")
    >>> check_attr_type(rule, "mode", 1)
    >>> check_attr_type(rule, "mode", [1, 1], node="y")
    Traceback (most recent call last):
    ...
    layout_prop.core.errors.OpError: bad-value at attrs.mode, node 'y': attr 'mode' of rotary_position_embedding \
must be one value (a number, a bool, a string or null), got [1, 1] (a list) (hint: write mode like its default, 0)
    """
    check = _attr_checks(rule).get(name)
    if check is None or any(test(value) for test in check[1]):
        return
    default = rule.attr_defaults.get(name)
    raise OpError("bad-value", f"attr {name!r} of {rule.name} must be {check[0]}, got {cut(value)} "
                  f"(a {type(value).__name__})", path=f"attrs.{name}", node=node,
                  hint=f"write {name} like its default, {cut(default)}" if default is not None else
                  f"write {name} as {check[0]}")


def apply_rule(rule: OpRule, inputs: tuple[TensorSpec, ...], attrs: dict) -> RuleResult:
    """``rule.infer_layout``, with strided shards gathered first for a rule that does not know them.

    A strided shard (``_S(d,k)``, left by a reshape that merged a sharded inner dim) is
    not a contiguous shard, so a rule that reads ``Shard`` placements must not see it.
    Unless the rule sets ``strided = True``, each input's strided mesh axes are taken
    as Replicate: the rule decides on that layout, wants it, and a fixable
    ``sharding-mismatch`` names the strided axes (``--reshard`` all-gathers them).

    Examples
    --------
    >>> from layout_prop import DeviceMesh, Layout, TensorSpec
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> x = TensorSpec((8, 4), "float32", Layout(mesh, ["_S(0,2)"], 2))
    >>> res = apply_rule(get_rule("swiglu"), (x,), get_rule("swiglu").normalize_attrs({}))
    >>> str(res.outputs[0].layout), [v.code for v in res.violations], str(res.wants[0])
    ('(R)', ['sharding-mismatch'], '(R)')
    """
    if rule.strided or not any(t.layout.has_strided for t in inputs):
        return rule.infer_layout(inputs, attrs)
    from .placement import Replicate, StridedShard
    from .redistribute import plan_redistribution

    plain = tuple(t if not t.layout.has_strided else t.with_layout(t.layout.with_placements(
        [Replicate() if isinstance(p, StridedShard) else p for p in t.layout.placements])) for t in inputs)
    res = rule.infer_layout(plain, attrs)
    wants = list(res.wants) + [None] * (len(inputs) - len(res.wants))
    violations = list(res.violations)
    for i, (t, p) in enumerate(zip(inputs, plain)):
        if p is t:
            continue
        want = wants[i] if wants[i] is not None else p.layout
        wants[i] = want
        operand = rule.operand_name(i)
        axes = [a for a in t.layout.strided_axes() if t.mesh.shape[a] > 1]
        if not axes:
            continue  # strided on size-1 mesh axes only: a relabel, which the move does for free
        try:
            plan_redistribution(t, want)
            fixable = True
        except LayoutPropError:
            fixable = False
        names = ", ".join(repr(t.mesh.names[a]) for a in axes)
        first = t.layout.placements[axes[0]]
        violations.append(Violation(
            "sharding-mismatch",
            f"{operand} is {t.layout}: {first} on mesh axis {names} is a strided shard (left by a reshape that "
            f"merged a sharded inner dim), which {rule.name} does not take; it computes on {operand} {want}",
            f"all-gather {operand} on {names}, or reshape back to the unmerged dims first",
            operand=operand, fixable=fixable, details={"want": want.placement_strs()}))
    return RuleResult(res.outputs, tuple(violations), tuple(wants))


def register_op(rule_cls: type[OpRule] | None = None):
    """Class decorator: instantiate the rule and register it under its name and aliases."""

    def wrap(cls: type[OpRule]) -> type[OpRule]:
        _load_builtin_ops()  # so a user op that reuses a built-in name is refused, whatever the import order
        rule = cls()
        if not rule.name:
            raise OpError("bad-rule", f"{cls.__name__} has no op name", hint="set the class attribute name")
        _attr_checks(rule)  # an unknown type in attr_types is refused here, not at the first node
        for name in (rule.name, *rule.aliases):
            if name in _RULES or name in _ALIASES:
                raise OpError("duplicate-op", f"op name {name!r} of {cls.__name__} is already registered",
                              hint="choose another op name or alias")
        _RULES[rule.name] = rule
        for alias in rule.aliases:
            _ALIASES[alias] = rule.name
        _VARIADIC["names"] = None
        return cls

    return wrap(rule_cls) if rule_cls is not None else wrap


_BUILTINS = {"loaded": False}
ENTRY_POINT_GROUP = "layout_prop.ops"


def _load_builtin_ops() -> None:
    """Import the built-in ops once (importing registers them), then plugins, before any lookup.

    Plugins are packages that declare an entry point in the ``layout_prop.ops`` group; loading
    the entry point imports the module that registers their ops (and kernels).
    """
    if _BUILTINS["loaded"]:
        return
    _BUILTINS["loaded"] = True
    import layout_prop.ops as builtin

    if not getattr(builtin, "LOADED", True):  # asked by a built-in family while the package imports them all:
        _BUILTINS["loaded"] = False  # plugins come after every built-in op (they may import any family)
        return
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except BaseException as exc:  # a broken plugin (even one that calls exit()): say which one, exit 2
            raise OpError("plugin-failed", f"loading op plugin {ep.name!r} ({ep.value}) failed: "
                          f"{describe(exc)}", hint="fix or uninstall that package") from exc


def get_rule(op: str, node: str | None = None, path: str | None = None) -> OpRule:
    """The rule of ``op`` (canonical name or alias); ``unknown-op`` otherwise."""
    _load_builtin_ops()
    name = _ALIASES.get(op, op)
    rule = _RULES.get(name)
    if rule is None:
        choices = list(_RULES) + list(_ALIASES)
        close = difflib.get_close_matches(str(op), choices, n=1)
        hint = f"did you mean {_ALIASES.get(close[0], close[0])!r}?" if close else \
            f"known ops: {', '.join(sorted(_RULES))}"
        raise OpError("unknown-op", f"unknown op {op!r}", node=node, path=path, hint=hint)
    return rule


def is_registered(op: str) -> bool:
    """Whether ``op`` is an op's name or alias (:func:`get_rule` without its error: no hint
    is searched for, which costs about 1 ms a name).

    >>> is_registered("mul"), is_registered("Mul"), is_registered("no_such_op")
    (True, True, False)
    """
    _load_builtin_ops()
    return op in _RULES or op in _ALIASES


def variadic_output_ops() -> frozenset[str]:
    """The names and aliases of the ops whose output count follows their attrs and input shapes
    (:attr:`OpRule.variadic_outputs`).

    >>> sorted(variadic_output_ops() & {"unbind", "chunk", "split", "unbind3", "add"})
    ['chunk', 'split', 'unbind']
    """
    _load_builtin_ops()
    if _VARIADIC["names"] is None:
        _VARIADIC["names"] = frozenset(name for name, rule in _RULES.items() if rule.variadic_outputs) | frozenset(
            alias for alias, name in _ALIASES.items() if _RULES[name].variadic_outputs)
    return _VARIADIC["names"]


_VARIADIC: dict[str, frozenset | None] = {"names": None}  # worked out on the first ask, reset by register_op


def registered_ops() -> dict[str, OpRule]:
    _load_builtin_ops()
    return dict(_RULES)


@dataclass(frozen=True)
class OpSample:
    """One set of operand shapes (and dtypes, attrs, requires_grad) to try an op with."""

    shapes: Sequence[Sequence[int]]
    attrs: dict = field(default_factory=dict)
    dtypes: Sequence[str] | None = None
    requires_grad: Sequence[bool] | None = None
    partial_ok: bool = True  # also try Partial placements on the operands
    strided: bool = False  # also try strided shards _S(d,2) (dims of even size >= 4)
