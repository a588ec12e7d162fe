"""lower: from the propagated, resharded global graph to one local program per rank.

SPMD: every rank runs the same sequence of local ops; what differs per rank is the
local shapes, the localised attrs (a rule's :meth:`localize`) and the rank groups of the
collectives.  Each op of the global graph becomes:

- a graph input: an ``input`` op that holds the rank's piece (``local_slices``);
- a ``redistribute`` node: one local op per step of its plan, ``slice`` for a free
  ``local-slice`` (one chunk of a dim), ``local`` for the other free steps (a
  ``local-partial``: zeros on all but the first rank of the group for ``P(sum)``; a
  ``local-slice`` to a strided shard: a chunk of each block) and ``collective`` for the
  rest, with explicit groups and reduce ops;
- any other op: a ``slice`` for each input its rule wants sliced (free wants only), then
  one ``kernel`` op, or, for an op that is communication (its rule's ``comm_steps``: a
  ring attention's ``ring_shift``), one ``collective`` op per step (a cyclic ``permute``).

The result is deterministic: the same spec gives byte-identical JSON.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> from layout_prop.api import analyze
>>> g = analyze(load_spec('''
... mesh: {shape: [2], names: [sp]}
... inputs:
...   x:   {shape: [1, 2, 4, 8], placements: ["S(2)"]}
...   cos: {shape: [1, 1, 4, 8]}
...   sin: {shape: [1, 1, 4, 8]}
... nodes:
...   - {name: y, op: rope, inputs: [x, cos, sin]}
... ''')).graph
>>> prog = Lower().run(g).program
>>> print(prog.format(rank=1))
rank 1 of DeviceMesh(sp=2):
  x = input() [1, 2, 2, 8] holds x[0:1, 0:2, 2:4, 0:8]
  cos = input() [1, 1, 4, 8] holds cos[0:1, 0:1, 0:4, 0:8]
  sin = input() [1, 1, 4, 8] holds sin[0:1, 0:1, 0:4, 0:8]
  cos@y = slice(cos) [1, 1, 2, 8] local-slice on sp dim 2
  sin@y = slice(sin) [1, 1, 2, 8] local-slice on sp dim 2
  y = rotary_position_embedding(x, cos@y, sin@y) [1, 2, 2, 8] {input_layout=null, mode=0}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from layout_prop.core import meta
from layout_prop.core.errors import ExecutionError
from layout_prop.core.graph import Graph, fresh_name
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.redistribute import Step, plan_redistribution
from layout_prop.core.registry import OpRule, get_rule
from layout_prop.core.spec import TensorSpec

from .propagate import value_spec

if TYPE_CHECKING:  # networkx is imported where a program is turned into a networkx graph
    import networkx

__all__ = ["Lower", "LocalOp", "Program", "LowerResult", "local_ops", "permute_op"]

#: The local op kind of each step that needs no communication.
_LOCAL_OP_KIND = {"local-slice": "slice", "local-partial": "local"}


@dataclass(frozen=True)
class LocalOp:
    """One op of the SPMD program.

    ``kind`` is ``input``, ``kernel``, ``slice``, ``local`` or ``collective``; ``op`` the kernel's op
    name or the step kind; ``specs`` the global specs of the outputs (each rank's local
    view follows from them); ``attrs`` one dict per rank (localised); ``step`` the planned
    step of a slice or collective; ``source`` the global node it comes from.
    """

    name: str
    kind: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    specs: tuple[TensorSpec, ...]
    attrs: tuple[dict, ...] = ()
    step: Step | None = None
    source: str = ""


@dataclass
class Program:
    mesh: DeviceMesh
    ops: list[LocalOp] = field(default_factory=list)
    specs: dict[str, TensorSpec] = field(default_factory=dict)  # global spec of every local value
    outputs: dict[str, str] = field(default_factory=dict)  # global output value -> local value

    def add(self, op: LocalOp) -> None:
        self.ops.append(op)
        for value, spec in zip(op.outputs, op.specs):
            self.specs[value] = spec

    @property
    def collectives(self) -> list[LocalOp]:
        return [op for op in self.ops if op.kind == "collective"]

    # ------------------------------------------------------------------ per-rank views
    def op_dict(self, op: LocalOp, rank: int) -> dict[str, Any]:
        d: dict[str, Any] = {"name": op.name, "kind": op.kind, "op": op.op, "inputs": list(op.inputs),
                             "outputs": list(op.outputs),
                             "local_shapes": [list(s.local_shape(rank)) for s in op.specs]}
        if op.attrs:
            d["attrs"] = op.attrs[rank]
        if op.kind == "input":  # a strided shard holds several ranges of a dim: a list of them there
            d["global_slices"] = [list(runs[0]) if len(runs) == 1 else [list(r) for r in runs]
                                  for runs in op.specs[0].local_runs(rank)]
        if op.step is not None:
            st = op.step
            d["mesh_axis"] = self.mesh.names[st.mesh_axis]
            d["group"] = list(self.mesh.group(rank, st.mesh_axis))
            if st.reduce_op:
                d["reduce_op"] = st.reduce_op
            if st.dim is not None:
                d["dim"] = st.dim
            if st.dst_dim is not None:
                d["dst_dim"] = st.dst_dim
            if st.shift is not None:  # a point-to-point permute: the coordinates it receives from and sends to
                d["shift"] = st.shift
                d["cyclic"] = st.cyclic
                d["recv_from"], d["send_to"] = _permute_peers(self.mesh, rank, st)
            d["bytes_per_rank"] = st.bytes_per_rank
        d["source"] = op.source
        return d

    def to_json(self, rank: int) -> str:
        return json.dumps({"rank": rank, "coords": list(self.mesh.coords(rank)), "mesh": self.mesh.to_dict(),
                           "ops": [self.op_dict(op, rank) for op in self.ops],
                           "outputs": self.outputs}, indent=1, sort_keys=True)

    def to_networkx(self, rank: int) -> "networkx.DiGraph":
        """Rank ``rank``'s local subgraph: one node per local op, edges along values."""
        import networkx as nx

        g = nx.DiGraph(rank=rank)
        producer = {}
        for op in self.ops:
            g.add_node(op.name, **self.op_dict(op, rank))
            for v in op.inputs:
                g.add_edge(producer[v], op.name, value=v)
            for v in op.outputs:
                producer[v] = op.name
        return g

    def format(self, rank: int) -> str:
        lines = [f"rank {rank} of {self.mesh}:"]
        for op in self.ops:
            d = self.op_dict(op, rank)
            shapes = " ".join(str(s) for s in d["local_shapes"])
            outs = ", ".join(op.outputs)
            if op.kind == "input":
                held = ", ".join(f"{e[0]}:{e[1]}" if isinstance(e[0], int) else "+".join(f"{a}:{b}" for a, b in e)
                                 for e in d["global_slices"])
                lines.append(f"  {outs} = input() {shapes} holds {op.name}[{held}]")
            elif op.step is not None:
                extra = f" dim {d['dim']}" if "dim" in d else ""
                extra += f" -> dim {d['dst_dim']}" if "dst_dim" in d else ""
                extra += f" op {d['reduce_op']}" if "reduce_op" in d else ""
                if "shift" in d:
                    extra += f" shift {d['shift']}{' cyclic' if d['cyclic'] else ''}: recv from {d['recv_from']}, " \
                             f"send to {d['send_to']}"
                group = "" if op.kind != "collective" else f" group {d['group']}, {d['bytes_per_rank']} bytes"
                lines.append(f"  {outs} = {op.kind}({', '.join(op.inputs)}) {shapes} {op.op} on "
                             f"{d['mesh_axis']}{extra}{group}")
            else:
                attrs = ""
                if d.get("attrs"):
                    attrs = " {" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(d["attrs"].items())) + "}"
                lines.append(f"  {outs} = {op.op}({', '.join(op.inputs)}) {shapes}{attrs}")
        return "\n".join(lines)


@dataclass
class LowerResult:
    program: Program


class Lower:
    """Lower a resharded, propagated graph to the SPMD program every rank runs.

    Parameters
    ----------
    localize : bool
        Give every kernel op its per-rank attrs (default).  ``False`` leaves ``attrs`` empty:
        the ops, values and specs only, for analyses that execute nothing (the memory pass
        reads :func:`local_ops` instead, without building a program).
    """

    name = "lower"

    def __init__(self, localize: bool = True) -> None:
        self.localize = localize

    def run(self, graph: Graph) -> LowerResult:
        prog = Program(graph.mesh)
        size = graph.mesh.size
        for name, kind, op, inputs, outputs, specs, step, source, node, rule, in_specs in local_ops(graph):
            if node is None:
                # an identity kernel (a redistribute node with no step) holds an empty dict per rank
                attrs = tuple({} for _ in range(size)) if kind == "kernel" else ()
                prog.add(LocalOp(name, kind, op, inputs, outputs, specs, attrs, step=step, source=source))
                continue
            attrs = node.meta[meta.ATTRS]
            if not self.localize:
                per_rank = ()
            elif type(rule).localize is OpRule.localize:  # the same attrs on every rank: one dict, shared
                per_rank = (dict(attrs),) * size
            else:
                if in_specs is None:  # no input was sliced: the kernel reads the values as they are
                    in_specs = tuple(value_spec(graph, value) for value in inputs)
                per_rank = tuple(rule.localize(attrs, in_specs, specs, r) for r in range(size))
            prog.add(LocalOp(name, kind, op, inputs, outputs, specs, per_rank, source=source))
        prog.outputs = {v: v for v in graph.outputs}
        return LowerResult(prog)


def local_ops(graph: Graph) -> Iterator[tuple]:
    """The ops of ``graph``'s lowered program, in order, as plain tuples: what :class:`Lower`
    makes its :class:`LocalOp` of, and what analyses that only walk the program (memory) read
    without building a program.

    Each is ``(name, kind, op, inputs, outputs, specs, step, source, node, rule, in_specs)``;
    ``node`` and ``rule`` are set for the kernel op of a graph node (None for inputs, steps and
    the identity of a redistribute node without steps), ``in_specs`` when its inputs were
    sliced first (None: the kernel reads its inputs as they are).

    Raises ``ExecutionError`` (``unresolved-violation``) as :class:`Lower` does.
    """
    defined: set[str] = set()  # every local value so far (the fresh names of slices and steps avoid them)
    env: dict[str, TensorSpec] = {}  # the spec of every graph value so far (value_spec, without the lookups)
    rules: dict[str, OpRule] = {}  # op -> rule, looked up once per op
    moves: dict[tuple[int, int], tuple] = {}  # (id of a spec, id of a wanted layout) -> (spec, layout, plan)
    comm_ops: set[str] = set()  # ops whose rule has comm_steps (lowered as their steps where it gives any)
    specs_key, violations_key, wants_key = meta.SPECS, meta.VIOLATIONS, meta.WANTS
    for node in graph.topo_order():
        m = node.meta
        out_specs = m[specs_key]
        op = node.op
        if op == "input":
            defined.add(node.name)
            env[node.name] = out_specs[0]
            yield node.name, "input", "input", (), (node.name,), (out_specs[0],), None, node.name, None, None, None
            continue
        violations = m.get(violations_key, ())
        if violations or (out_specs[0] is None if len(out_specs) == 1 else _has_none(out_specs)):
            v = violations[0] if violations else None
            raise ExecutionError(
                "unresolved-violation",
                f"node {node.name!r} cannot be lowered: {v if v else 'its inputs are unusable'}",
                node=node.name, hint="fix the violations first, or let run apply --reshard")
        if op == "redistribute":
            src = _spec_of(env, graph, node.inputs[0])
            dst = out_specs[0]
            plan = plan_redistribution(src, dst.layout)
            if not plan.steps:
                yield node.name, "kernel", "identity", node.inputs, (node.name,), (dst,), None, node.name, None, \
                    None, None
            else:
                yield from _steps(defined, node.inputs[0], plan.steps, node.name, node.name)
            defined.add(node.name)
            env[node.name] = dst
            continue
        rule = rules.get(op)
        if rule is None:
            rule = rules[op] = get_rule(op)
            if rule.is_communication:
                comm_ops.add(op)
        wants = m.get(wants_key, ())
        args = in_specs = None  # None while every input is read as it is
        if len(wants) != len(node.inputs):
            args, in_specs = [], []
        for i, (value, want) in enumerate(zip(node.inputs, wants)):
            src = env.get(value)
            if src is None:
                src = value_spec(graph, value)  # (which raises for a value no node makes)
            if want is None or want is src.layout:
                move = None
            else:  # specs and layouts are uniqued: mostly the same objects, compared once a pair
                move = moves.get((id(src), id(want)))
                if move is None:  # (both held in the entry, so that their ids stay theirs)
                    plan = None if want == src.layout else plan_redistribution(src, want)
                    move = moves[id(src), id(want)] = (src, want, plan, plan is None or plan.is_free)
            if move is None or move[2] is None:  # read as it is (an equal layout: no plan)
                if args is not None:
                    args.append(value)
                    in_specs.append(src)
                continue
            plan = move[2]
            if not move[3]:
                raise ExecutionError("unresolved-violation", f"input {value!r} of {node.name!r} needs "
                                     f"communication ({src.layout} -> {want})", node=node.name, input=value,
                                     hint="run the reshard pass first")
            if args is None:  # the first input to slice: the ones before it are read as they are
                args = list(node.inputs[:i])
                in_specs = [_spec_of(env, graph, v) for v in args]
            local = f"{value}@{node.name}"
            if local in defined:
                local = _fresh(defined, local)
            if len(plan.steps) == 1:  # the common move: one local slice
                step = plan.steps[0]
                defined.add(local)
                yield local, _kind(step), step.kind, (value,), (local,), (step.dst,), step, node.name, None, None, \
                    None
            else:
                local = yield from _steps(defined, value, plan.steps, local, node.name)  # no steps: value itself
            args.append(local)
            in_specs.append(plan.dst)
        if op in comm_ops:  # an op that is communication (a ring's shift): its steps instead of a kernel
            read = node.inputs if args is None else tuple(args)
            steps = rule.comm_steps(m[meta.ATTRS], tuple(_spec_of(env, graph, v) for v in node.inputs)
                                    if in_specs is None else tuple(in_specs), out_specs)
            if steps:
                yield from _steps(defined, read[0], steps, node.name, node.name)
                defined.add(node.name)
                env[node.name] = out_specs[0]
                continue
        yield node.name, "kernel", rule.name, node.inputs if args is None else tuple(args), node.outputs, \
            out_specs, None, node.name, node, rule, None if in_specs is None else tuple(in_specs)
        if len(out_specs) == 1:
            defined.add(node.name)
            env[node.name] = out_specs[0]
        else:
            defined.update(node.outputs)
            env.update(zip(node.outputs, out_specs))


def _has_none(specs: tuple) -> bool:
    for spec in specs:  # identity only: ``None in specs`` would call TensorSpec.__eq__ on each
        if spec is None:
            return True
    return False


def _permute_peers(mesh: DeviceMesh, rank: int, step: Step) -> tuple[int | None, int | None]:
    """``(sender, receiver)`` of ``rank`` in a permute step (None where there is none: a line's ends)."""
    group = mesh.group(rank, step.mesh_axis)
    n, k = len(group), group.index(rank)
    peers = []
    for other in (k - step.shift, k + step.shift):
        if step.cyclic:
            other %= n
        peers.append(int(group[other]) if 0 <= other < n else None)
    return peers[0], peers[1]


def permute_op(value: str, step: Step, name: str, source: str) -> LocalOp:
    """The local op of a point-to-point ``permute`` step (:func:`~layout_prop.core.redistribute.permute_step`)
    from local value ``value`` to ``name``: a ``collective`` every engine runs as it runs the others."""
    return LocalOp(name, "collective", step.kind, (value,), (name,), (step.dst,), step=step, source=source)


def _kind(step: Step) -> str:
    """The local op kind of a plan's step."""
    kind = _LOCAL_OP_KIND.get(step.kind, "collective")
    if kind == "slice" and step.dst.layout.has_strided and not step.dst.layout.placements[step.mesh_axis].is_shard():
        kind = "local"  # a strided slice keeps several ranges: not the plain chunk of a "slice" op
    return kind


def _spec_of(env: dict, graph: Graph, value: str) -> TensorSpec:
    spec = env.get(value)
    return value_spec(graph, value) if spec is None else spec  # (which raises for a value no node makes)


def _fresh(defined: set[str], base: str) -> str:
    """A local value name no op of the program uses yet."""
    return fresh_name(base, defined.__contains__, sep=".")


def _steps(defined: set[str], value: str, steps, final: str, source: str):
    """Yield one local op per step of a plan from ``value`` to ``final``; returns ``final``."""
    current = value
    for k, step in enumerate(steps):
        name = final if k == len(steps) - 1 else _fresh(defined, f"{final}#{k}")
        kind = _kind(step)
        defined.add(name)
        yield name, kind, step.kind, (current,), (name,), (step.dst,), step, source, None, None, None
        current = name
    return current
