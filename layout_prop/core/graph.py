"""A tiny dataflow graph IR on a networkx ``MultiDiGraph``.

Nodes are graph inputs (``op == "input"``) or op applications.  A node produces one
value named like the node, or, for a multi-output op, values ``name:0``, ``name:1``...
Edges go from producer to consumer, one per use (the same value may feed an op twice),
keyed by the consumer's input index.  The graph keeps its nodes in one dict (insertion
order; a value's producer is found from the value's name) and builds the uses index and
the networkx view when first asked for after a change: passes that rebuild large graphs
do not pay for networkx's bookkeeping, and algorithms (cycles, generations, drawing)
still get a real networkx graph.  Passes talk through named keys of ``node.meta`` (see :mod:`layout_prop.core.meta`),
as torch.fx passes do.

Examples
--------
>>> from layout_prop import DeviceMesh
>>> g = Graph(DeviceMesh((2,), ("dp",)))
>>> x = g.input("x", shape=(4, 8))
>>> y = g.op("y", "add", [x, x])
>>> g.output(y)
>>> g.lint()
>>> print(g.format())
graph(mesh=DeviceMesh(dp=2)):
  x = input() {shape=[4, 8], dtype=float32, placements=["R"], requires_grad=true}
  y = add(x, x)
  return y
"""

from __future__ import annotations

import gc
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from .errors import GraphError, LayoutPropError
from .mesh import DeviceMesh
from .spec import FLOAT_DTYPES

if TYPE_CHECKING:  # networkx is imported where the view is built: not on the command line's hot path
    import networkx as nx

__all__ = ["Node", "Graph", "attrs_key", "freeze_attrs", "last_uses", "value_name", "split_value", "paused_gc"]


def freeze_attrs(value: Any) -> Any:
    """A hashable, order-independent copy of an attrs value (dicts become sorted item tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, freeze_attrs(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze_attrs(v) for v in value)
    return value


def attrs_key(value: Any) -> Any:
    """A hashable key of an attrs value that, unlike :func:`freeze_attrs`, tells apart
    values Python finds equal: ``1``, ``1.0`` and ``True`` (a rule may accept one and
    reject another).

    >>> attrs_key({"mode": True}) == attrs_key({"mode": 1})
    False
    """
    if isinstance(value, dict):
        return tuple(sorted((k, attrs_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        types = tuple(map(type, value))
        if _SCALAR_TYPES.issuperset(types):  # a shape or a dims list: no recursion
            return type(value), tuple(value), types
        return (type(value),) + tuple(attrs_key(v) for v in value)
    return type(value), value


_SCALAR_TYPES = frozenset((int, float, bool, str, type(None)))


def last_uses(steps: Sequence, keep: set[str]) -> dict[int, list[str]]:
    """Step index -> the values (not in ``keep``) read there for the last time, or made there
    and never read: where an executor may drop them.

    ``steps`` are anything with ``inputs`` and ``outputs`` in execution order (graph nodes,
    a lowered program's ops).

    >>> from types import SimpleNamespace as NS
    >>> steps = [NS(inputs=(), outputs=("a",)), NS(inputs=("a",), outputs=("b",)),
    ...          NS(inputs=("b", "a"), outputs=("c", "d"))]
    >>> last_uses(steps, keep={"c"})
    {2: ['a', 'b', 'd']}
    """
    last: dict[str, int] = {}
    for index, step in enumerate(steps):
        for value in (*step.inputs, *step.outputs):
            last[value] = index
    dying: dict[int, list[str]] = {}
    for value, index in last.items():
        if value not in keep:
            dying.setdefault(index, []).append(value)
    return dying


def fresh_name(base: str, taken: Callable[[str], bool], sep: str = "", first: int = 2) -> str:
    """``base``, else ``base{sep}{first}``, ``base{sep}{first + 1}``...: the first name ``taken`` refuses.

    The one maker of fresh names: every pass and builder that invents a node or value name
    asks here, with its own ``taken`` (the graphs and nodes it must not clash with) and its
    spelling (``sep``: ``/`` for ZeRO's and recomputation's copies, ``.`` for lowering's local
    values, ``_`` from 1 for the importers).

    >>> fresh_name("x", {"x", "x2"}.__contains__), fresh_name("v", {"v"}.__contains__, sep="_", first=1)
    ('x3', 'v_1')
    """
    name, k = base, first
    while taken(name):
        name, k = f"{base}{sep}{k}", k + 1
    return name


def value_name(node: str, index: int, num_outputs: int) -> str:
    """The name of output ``index`` of ``node``."""
    return node if num_outputs == 1 else f"{node}:{index}"


#: the most digits an output index is written with (a longer run of digits names no output)
MAX_INDEX_DIGITS = 18


def split_value(value: str) -> tuple[str, int]:
    """``"qkv:1"`` -> ``("qkv", 1)``; ``"x"`` -> ``("x", 0)``.

    Only ASCII digits, at most :data:`MAX_INDEX_DIGITS` of them, are an index: ``"x:²"`` or a
    colon followed by thousands of digits is a name (that no node defines), not a crash in
    ``int()``.

    >>> split_value("qkv:1"), split_value("x"), split_value("x:²"), split_value("x:" + "9" * 30)[1]
    (('qkv', 1), ('x', 0), ('x:²', 0), 0)
    """
    if ":" in value:
        head, _, tail = value.rpartition(":")
        if tail.isascii() and tail.isdigit() and len(tail) <= MAX_INDEX_DIGITS:
            return head, int(tail)
    return value, 0


@dataclass(eq=False, slots=True)
class Node:
    """One node: a graph input or an op application.

    ``attrs`` are the op's attributes (treated as immutable); ``meta`` is the scratch
    space through which passes talk (``meta["specs"]``, ``meta["violations"]``...).
    """

    name: str
    op: str
    inputs: tuple[str, ...] = ()
    attrs: dict = field(default_factory=dict)
    num_outputs: int = 1
    meta: dict = field(default_factory=dict)
    outputs: tuple[str, ...] = field(init=False, repr=False)  # the value names, set from name and num_outputs

    @property
    def is_input(self) -> bool:
        return self.op == "input"

    def __post_init__(self) -> None:
        # the value names, computed once (a plain attribute: read for every node by every pass)
        self.outputs = (self.name,) if self.num_outputs == 1 else tuple(
            value_name(self.name, i, self.num_outputs) for i in range(self.num_outputs))

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.op!r}, inputs={list(self.inputs)})"


class Graph:
    """A dataflow graph over a device mesh.

    Parameters
    ----------
    mesh : DeviceMesh
        The mesh every value of the graph lives on.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._nx: "nx.MultiDiGraph | None" = None
        self._nodes: dict[str, Node] = {}
        # producer node name -> [(consumer, input index)], built on demand (like the networkx view)
        self._uses: dict[str, list[tuple[Node, int]]] | None = None
        self.outputs: list[str] = []
        self.meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ building
    def input(
        self,
        name: str,
        *,
        shape: Iterable[int] | None = None,
        dtype: str = "float32",
        placements: Iterable | str | None = None,
        requires_grad: bool | None = None,
    ) -> str:
        """Add a graph input; ``placements`` is a list of placements or ``"auto"``.

        ``requires_grad`` defaults to true for the floating dtypes and false for the others
        (token ids, masks).  Passes that cut a graph into pieces set it as the flow of
        gradients decides; the spec loader refuses it on an integer input.
        """
        if requires_grad is None:
            requires_grad = dtype in FLOAT_DTYPES
        attrs = {
            "shape": tuple(shape) if shape is not None else None,
            "dtype": dtype,
            "placements": placements if isinstance(placements, str) or placements is None else tuple(
                str(p) for p in placements),
            "requires_grad": bool(requires_grad),
        }
        if attrs["placements"] is None:
            attrs["placements"] = ("R",) * self.mesh.ndim
        return self.add_node(Node(name, "input", (), attrs))[0]

    def op(self, name: str, op: str, inputs: Iterable[str], attrs: dict | None = None,
           num_outputs: int | None = None) -> str | tuple[str, ...]:
        """Add an op node; returns its value name (a tuple of names for several outputs).

        ``num_outputs`` defaults to 1, or, for an op whose output count follows its attrs and
        input shapes (``unbind``, ``chunk``, ``split``), to that count (:func:`output_counts`).

        >>> from layout_prop import DeviceMesh
        >>> g = Graph(DeviceMesh((2,), ("dp",)))
        >>> g.op("u", "unbind", [g.input("x", shape=(3, 4))])
        ('u:0', 'u:1', 'u:2')
        """
        node = Node(name, op, tuple(inputs), dict(attrs or {}), num_outputs or 1)
        if num_outputs is None:
            node = output_counts([node], self._nodes, self.mesh)[0]
        outs = self.add_node(node)
        return outs[0] if node.num_outputs == 1 else outs

    def add_node(self, node: Node) -> tuple[str, ...]:
        """Insert a prepared node; its inputs must already be defined."""
        if node.name in self._nodes:
            raise GraphError("duplicate-name", f"a node named {node.name!r} already exists", node=node.name,
                             hint="give every node and input a distinct name")
        for value in node.outputs:  # "g:1" names output 1 of a multi-output node g: never two things
            if (value != node.name and value in self._nodes) or (":" in value and self.has_value(value)):
                raise GraphError("duplicate-name", f"node {node.name!r} would define value {value!r}, which "
                                 f"already exists", node=node.name,
                                 hint="names with ':' clash with the values of multi-output nodes; rename it")
        nodes = self._nodes
        for i, value in enumerate(node.inputs):
            producer = nodes.get(value)  # the common value: a single-output node's (has_value, inlined)
            if (producer is None or producer.num_outputs != 1) and not self.has_value(value):
                raise GraphError("undefined-value", f"input {i} of {node.name!r} refers to undefined value {value!r}",
                                 node=node.name, input=value, hint="define a value before using it")
        nodes[node.name] = node
        self._uses = self._nx = None  # indexes rebuilt on demand
        return node.outputs

    def extend_checked(self, nodes: Iterable[Node]) -> None:
        """Append op nodes that the caller has already checked as :meth:`add_node` would.

        For a builder that checks a whole list at once (the spec loader): the nodes come
        in order, their names and values are new and distinct, and every input is a value
        defined before it.  Nothing is checked again here; :meth:`lint` checks the result.
        """
        table = self._nodes
        for node in nodes:
            table[node.name] = node
        self._uses = self._nx = None

    @property
    def nx(self) -> "nx.MultiDiGraph":
        """The networkx view: a node per graph node (data ``node``), an edge per use.

        Edges go from producer to consumer, keyed by the consumer's input index, with data
        ``value`` (the value name) and ``index`` (the producer's output index).  Built when
        first asked for after a change; edits to it are not reflected back in the graph.
        """
        if self._nx is None:
            import networkx as nx

            view = nx.MultiDiGraph()
            for node in self._nodes.values():
                view.add_node(node.name, node=node)
                for i, value in enumerate(node.inputs):
                    producer, index = self.producer(value)
                    view.add_edge(producer.name, node.name, key=i, value=value, index=index)
            self._nx = view
        return self._nx

    def output(self, *values: str) -> None:
        """Mark values as graph outputs."""
        for value in values:
            if not self.has_value(value):
                raise GraphError("undefined-value", f"output {value!r} is not a value of the graph", input=value,
                                 hint="name a node (or node:i) as an output")
            self.outputs.append(value)

    # ------------------------------------------------------------------ queries
    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphError("undefined-value", f"no node named {name!r}", node=name,
                             hint="check the spelling of the node name") from None

    @property
    def nodes(self) -> list[Node]:
        """Nodes in insertion order."""
        return list(self._nodes.values())

    def inputs(self) -> list[Node]:
        return [n for n in self._nodes.values() if n.op == "input"]  # (is_input, without a call per node)

    def has_value(self, value: str) -> bool:
        """Whether some node produces ``value`` (what :meth:`producer` finds, without raising)."""
        node = self._nodes.get(value)
        if node is not None and node.num_outputs == 1:
            return True
        name, index = split_value(value)
        node = self._nodes.get(name)
        return node is not None and node.num_outputs != 1 and 0 <= index < node.num_outputs and value != name

    def producer(self, value: str) -> tuple[Node, int]:
        """The node that produces ``value`` and the output index."""
        node = self._nodes.get(value)
        if node is not None and node.num_outputs == 1:
            return node, 0
        name, index = split_value(value)
        node = self._nodes.get(name)
        if node is None or node.num_outputs == 1 or not 0 <= index < node.num_outputs or value == name:
            hint = "a multi-output node's values are named node:i" if node is not None else "define it first"
            raise GraphError("undefined-value", f"no value named {value!r}", input=value, hint=hint)
        return node, index

    def consumers(self, value: str) -> list[tuple[Node, int]]:
        """Nodes that read ``value``, with the input index, in node order."""
        producer, _ = self.producer(value)
        if self._uses is None:
            uses: dict[str, list[tuple[Node, int]]] = {name: [] for name in self._nodes}
            for node in self._nodes.values():
                for i, used in enumerate(node.inputs):
                    uses[self.producer(used)[0].name].append((node, i))
            self._uses = uses
        return [(node, i) for node, i in self._uses[producer.name] if node.inputs[i] == value]

    def topo_order(self) -> list[Node]:
        """A topological order: insertion order, since a node's inputs must exist before it."""
        return list(self._nodes.values())

    def __iter__(self) -> Iterator[Node]:
        return iter(self.topo_order())

    def _cycle(self) -> list[str]:
        import networkx as nx

        try:
            return [u for u, *_ in nx.find_cycle(self.nx)]
        except nx.NetworkXNoCycle:
            return []

    # ------------------------------------------------------------------ checking
    def lint(self) -> None:
        """Check the graph is well formed: arity, defined-before-use, unique names, acyclic.

        Raises
        ------
        GraphError
        """
        import networkx as nx

        from .registry import get_rule

        if not nx.is_directed_acyclic_graph(self.nx):
            raise GraphError("cycle", f"the graph has a cycle through {self._cycle()}",
                             hint="a value cannot depend on itself")
        position = {name: i for i, name in enumerate(self._nodes)}
        for src, dst in self.nx.edges():
            if position[src] >= position[dst]:
                raise GraphError("bad-order", f"{dst!r} comes before its input's producer {src!r}",
                                 node=dst, hint="build graphs through Graph.op")
        for node in self._nodes.values():
            for i, value in enumerate(node.inputs):
                if not self.has_value(value):
                    raise GraphError("undefined-value", f"input {i} of {node.name!r} is undefined value {value!r}",
                                     node=node.name, input=value, hint="define a value before using it")
            if node.is_input:
                if node.inputs:
                    raise GraphError("bad-arity", f"graph input {node.name!r} has inputs", node=node.name,
                                     hint="graph inputs take no inputs")
                continue
            rule = get_rule(node.op, node=node.name)
            rule.check_arity(node)
            edges = sorted(k for _, _, k in self.nx.in_edges(node.name, keys=True))
            if edges != list(range(len(node.inputs))):
                raise GraphError("bad-edges", f"node {node.name!r} has edges {edges} for {len(node.inputs)} inputs",
                                 node=node.name, hint="build graphs through Graph.op")
        for value in self.outputs:
            if not self.has_value(value):
                raise GraphError("undefined-value", f"output {value!r} is undefined", input=value,
                                 hint="name a node as an output")

    # ------------------------------------------------------------------ printing
    def format(self, meta_keys: Iterable[str] = ()) -> str:
        """A stable text form for golden tests; ``meta_keys`` adds chosen metadata."""
        lines = [f"graph(mesh={self.mesh}):"]
        for node in self.topo_order():
            outs = ", ".join(node.outputs)
            args = ", ".join(node.inputs)
            attrs = node.attrs
            if node.is_input:
                attrs = {
                    "shape": list(attrs["shape"]) if attrs["shape"] is not None else None,
                    "dtype": attrs["dtype"],
                    "placements": attrs["placements"] if isinstance(attrs["placements"], str) else list(
                        attrs["placements"]),
                    "requires_grad": attrs["requires_grad"],
                }
                text = f"  {outs} = input()"
            else:
                text = f"  {outs} = {node.op}({args})"
            if attrs:
                text += " {" + ", ".join(f"{k}={_fmt(v)}" for k, v in attrs.items()) + "}"
            for key in meta_keys:
                if key in node.meta:
                    text += f"  # {key}: {_fmt_meta(node.meta[key])}"
            lines.append(text)
        lines.append("  return " + ", ".join(self.outputs))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    # ------------------------------------------------------------------ copying
    @classmethod
    def from_nodes(cls, mesh: DeviceMesh, nodes: Iterable[Node] | dict[str, Node], outputs: Iterable[str] = (),
                   graph_meta: dict | None = None) -> "Graph":
        """A graph of ``nodes`` taken in order, built in bulk for transforming passes.

        The nodes must come from a well-formed graph (with inserted nodes placed before
        their consumers); unlike :meth:`add_node` nothing is checked here, so a pass that
        rebuilds a large graph pays a few dict writes per node.  :meth:`lint` (which the
        tests run after every pass) checks the result.  A dict of name -> node (in order)
        becomes the graph's own: the caller hands it over and does not change it after.
        """
        g = cls(mesh)
        g.outputs = list(outputs)
        g.meta.update(graph_meta or {})
        g._nodes = nodes if isinstance(nodes, dict) else {node.name: node for node in nodes}
        return g

    def copy_structure(self) -> "Graph":
        """A new graph with the same nodes (attrs copied, meta empty) and outputs."""
        g = Graph(self.mesh)
        for node in self.topo_order():
            g.add_node(Node(node.name, node.op, node.inputs, dict(node.attrs), node.num_outputs))
        g.outputs = list(self.outputs)
        return g


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError:
        return str(value)


def _fmt_meta(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


@contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector while passes build many small objects.

    The passes create no reference cycles worth collecting mid-run, and a collector that
    rescans every live node at each generation-2 collection made analysis superlinear
    in the graph size (measured by ``benchmarks/propagate.py``).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ------------------------------------------------------------------ output counts
def output_counts(nodes: Sequence[Node], known: dict[str, Node], mesh: DeviceMesh) -> list[Node]:
    """``nodes`` with the output count of each node whose op's count follows its attrs and input
    shapes (:attr:`OpRule.variadic_outputs <layout_prop.core.registry.OpRule.variadic_outputs>`:
    ``unbind``, ``chunk``, ``split``) worked out; the other nodes are returned as they are.

    An input's shape is worked out from the graph's inputs by the rules themselves, on
    replicated layouts (only the ancestors of such nodes are visited: a graph without them
    costs one set of op names).  ``known`` holds the nodes built so far by name (the graph's
    inputs among them); ``nodes`` may come in any order and refer to one another.  Where an
    input's shape cannot be worked out (an ancestor whose rule rejects its inputs, which
    propagation reports), the count is what the node's consumers name (``u:2``: at least 3):
    propagation then skips the node.

    Raises
    ------
    OpError
        The rule's own error where attrs and known shapes give no count (``invalid-dim``...),
        with the node named.

    Examples
    --------
    >>> from layout_prop import DeviceMesh
    >>> mesh = DeviceMesh((2,), ("dp",))
    >>> x = Node("x", "input", (), {"shape": (6, 4), "dtype": "float32", "placements": ("R",)})
    >>> nodes = [Node("h", "add", ("x", "x")), Node("c", "chunk", ("h",), {"chunks": 4})]
    >>> [n.outputs for n in output_counts(nodes, {"x": x}, mesh)]
    [('h',), ('c:0', 'c:1', 'c:2')]
    """
    from .registry import is_registered, get_rule, variadic_output_ops

    variadic = variadic_output_ops()
    if variadic.isdisjoint({node.op for node in nodes}):
        return list(nodes)
    table = dict(known)
    table.update((node.name, node) for node in nodes)
    memo: dict[str, tuple | None] = {}
    out = []
    for node in nodes:
        if node.op not in variadic or not is_registered(node.op):
            out.append(node)
            continue
        rule = get_rule(node.op, node=node.name)
        specs = [_replicated_spec(value, table, mesh, memo) for value in node.inputs]
        if any(spec is None for spec in specs):
            count = _named_count(node.name, nodes)
        else:
            attrs = rule.normalize_attrs(node.attrs, node.name)
            try:
                count = rule.output_count(attrs, tuple(spec.shape for spec in specs))
            except LayoutPropError as err:
                if err.node is None:
                    err.node = node.name
                raise
        out.append(node if count == node.num_outputs else
                   Node(node.name, node.op, node.inputs, node.attrs, count, node.meta))
        table[node.name] = out[-1]
    return out


def _named_count(name: str, nodes: Sequence[Node]) -> int:
    """The count the consumers of node ``name`` name: 1 + the highest ``name:i`` (1 when none)."""
    indexes = [index for node in nodes for value in node.inputs
               for head, index in [split_value(value)] if head == name and value != name]
    return max(indexes) + 1 if indexes else 1


def _replicated_spec(value: str, table: dict[str, Node], mesh: DeviceMesh, memo: dict) -> "TensorSpec | None":
    """The spec of ``value`` with every layout replicated, worked out by the rules from the graph's
    inputs (``memo``: node name -> its output specs, None where unknown); None where unknown."""
    base, index = (value, 0) if value in table else split_value(value)
    if base not in memo:
        _infer_replicated(base, table, mesh, memo)
    specs = memo.get(base)
    return specs[index] if specs is not None and index < len(specs) else None


def _infer_replicated(name: str, table: dict[str, Node], mesh: DeviceMesh, memo: dict) -> None:
    """Fill ``memo`` for node ``name`` and its ancestors, depth first without recursion (a cycle,
    which the graph builder reports, leaves its nodes unknown)."""
    visiting: set[str] = set()
    stack = [(name, False)]
    while stack:
        current, ready = stack.pop()
        if current in memo:
            continue
        node = table.get(current)
        if node is None or (not ready and current in visiting):
            memo[current] = None
            continue
        bases = {value if value in table else split_value(value)[0] for value in node.inputs}
        if not ready:
            visiting.add(current)
            stack.append((current, True))
            stack.extend((base, False) for base in sorted(bases) if base not in memo)
            continue
        memo[current] = _replicated_outputs(node, [_replicated_spec(v, table, mesh, memo) for v in node.inputs], mesh)


def _replicated_outputs(node: Node, specs: list, mesh: DeviceMesh) -> tuple | None:
    """The output specs of ``node`` on replicated inputs ``specs`` (None where its rule gives none)."""
    from .layout import Layout
    from .registry import apply_rule, get_rule
    from .spec import TensorSpec

    try:
        if node.is_input:
            shape = node.attrs.get("shape")
            return None if shape is None else (
                TensorSpec(tuple(shape), node.attrs.get("dtype", "float32"), Layout(mesh, ["R"] * mesh.ndim, len(shape))),)
        if any(spec is None for spec in specs):
            return None
        rule = get_rule(node.op, node=node.name)
        attrs = rule.normalize_attrs(node.attrs, node.name)
        result = apply_rule(rule, tuple(specs), attrs) if specs else rule.infer_source_layout(mesh, attrs)
        return tuple(result.outputs)
    except Exception:  # noqa: BLE001 -- a rule that cannot describe the node: propagation reports it
        return None
