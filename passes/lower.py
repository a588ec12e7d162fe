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
  one ``kernel`` op.

The result is deterministic: the same spec gives byte-identical JSON.

Examples
--------
>>> from layout_prop.loader import load_spec
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
from typing import Any


from layout_prop import meta
from layout_prop.errors import ExecutionError
from layout_prop.graph import Graph
from layout_prop.mesh import DeviceMesh
from layout_prop.redistribute import Step, plan_redistribution
from layout_prop.registry import OpRule, get_rule
from layout_prop.spec import TensorSpec

from .propagate import value_spec

__all__ = ["Lower", "LocalOp", "Program", "LowerResult"]

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
        the ops, values and specs only, for analyses that execute nothing (memory).
    """

    name = "lower"

    def __init__(self, localize: bool = True) -> None:
        self.localize = localize

    def run(self, graph: Graph) -> LowerResult:
        prog = Program(graph.mesh)
        for node in graph.topo_order():
            if node.is_input:
                spec = node.meta[meta.SPECS][0]
                prog.add(LocalOp(node.name, "input", "input", (), (node.name,), (spec,), source=node.name))
                continue
            violations = node.meta.get(meta.VIOLATIONS, ())
            if violations or any(s is None for s in node.meta[meta.SPECS]):
                v = violations[0] if violations else None
                raise ExecutionError(
                    "unresolved-violation",
                    f"node {node.name!r} cannot be lowered: {v if v else 'its inputs are unusable'}",
                    node=node.name, hint="fix the violations first, or let run apply --reshard")
            if node.op == "redistribute":
                self._redistribute(prog, graph, node)
                continue
            args = []
            rule = get_rule(node.op)
            in_specs = []
            for i, (value, want) in enumerate(zip(node.inputs, node.meta.get(meta.WANTS, ()))):
                src = value_spec(graph, value)
                if want is None or want == src.layout:
                    args.append(value)
                    in_specs.append(src)
                    continue
                plan = plan_redistribution(src, want)
                if not plan.is_free:
                    raise ExecutionError("unresolved-violation", f"input {value!r} of {node.name!r} needs "
                                         f"communication ({src.layout} -> {want})", node=node.name, input=value,
                                         hint="run the reshard pass first")
                args.append(self._steps(prog, value, plan.steps, self._fresh(prog, f"{value}@{node.name}"),
                                        node.name))
                in_specs.append(plan.dst)
            out_specs = node.meta[meta.SPECS]
            attrs = node.meta[meta.ATTRS]
            if not self.localize:
                per_rank = ()
            elif type(rule).localize is OpRule.localize:  # the same attrs on every rank: one dict, shared
                per_rank = (dict(attrs),) * graph.mesh.size
            else:
                per_rank = tuple(rule.localize(attrs, tuple(in_specs), out_specs, r) for r in range(graph.mesh.size))
            prog.add(LocalOp(node.name, "kernel", rule.name, tuple(args), node.outputs, out_specs, per_rank,
                             source=node.name))
        prog.outputs = {v: v for v in graph.outputs}
        return LowerResult(prog)

    def _redistribute(self, prog: Program, graph: Graph, node) -> None:
        src = value_spec(graph, node.inputs[0])
        dst = node.meta[meta.SPECS][0]
        plan = plan_redistribution(src, dst.layout)
        if not plan.steps:
            attrs = tuple({} for _ in range(graph.mesh.size))
            prog.add(LocalOp(node.name, "kernel", "identity", node.inputs, (node.name,), (dst,), attrs,
                             source=node.name))
            return
        self._steps(prog, node.inputs[0], plan.steps, node.name, node.name)

    @staticmethod
    def _fresh(prog: Program, base: str) -> str:
        """A local value name no op of the program uses yet."""
        name, i = base, 1
        while name in prog.specs:
            i += 1
            name = f"{base}.{i}"
        return name

    @staticmethod
    def _steps(prog: Program, value: str, steps, final: str, source: str) -> str:
        current = value
        for k, step in enumerate(steps):
            name = final if k == len(steps) - 1 else Lower._fresh(prog, f"{final}#{k}")
            kind = _LOCAL_OP_KIND.get(step.kind, "collective")
            if kind == "slice" and step.dst.layout.has_strided and not step.dst.layout.placements[step.mesh_axis]\
                    .is_shard():
                kind = "local"  # a strided slice keeps several ranges: not the plain chunk of a "slice" op
            prog.add(LocalOp(name, kind, step.kind, (current,), (name,), (step.dst,), step=step, source=source))
            current = name
        return current
