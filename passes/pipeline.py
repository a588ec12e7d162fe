"""pipeline: stages on a mesh axis, the point-to-point moves between them, and each rank's schedule.

A spec's ``pipeline:`` block (docs/pipeline.md) names a mesh axis (by convention ``pp``) whose
coordinate ``s`` holds stage ``s``, the schedule and the number of micro-batches::

    pipeline:
      axis: pp
      micro_batches: 4
      schedule: 1f1b            # gpipe | 1f1b | interleaved
      virtual_stages: 1         # interleaved: model chunks per stage
      boundaries: [l2_h]        # the first node of chunks 1.. (a name, or a layer index: [2]), or
      layers: [3, 1]            # layers per chunk (nodes named l<i>_...), or neither: balanced

The model is cut into ``p * v`` consecutive chunks (chunk ``c`` on stage ``c % p``,
:mod:`layout_prop.passes.schedule`).  Every stage runs the graph's ops on the other mesh
axes (the *stage mesh*): the graph is analysed once for one micro-batch on that mesh
(:func:`micro_batch_graph`: the batch inputs' dim 0 divided by ``micro_batches``), with its
backward, and each node is given a *position* in a micro-batch's life: chunk ``c``'s forward
is position ``c``, its backward ``2C - 1 - c`` (:func:`assign_positions`).  Every edge whose
two ends sit on different stages gets a point-to-point ``permute`` on the pipeline axis
(:func:`~layout_prop.core.redistribute.permute_step`: forward activations one stage on,
their gradients one stage back); :func:`verify_pipeline` checks that every edge runs forward
in time and crosses stages only through a move.  :func:`lower_pipeline` writes the program:
the stage mesh's SPMD program cut into tasks, the moves before each task, and every stage's
schedule.

A move that only feeds the parameters' gradients through sums (:func:`summed_once`: a tied
embedding's gradient term from the head, on the last stage, to the embedding's on the
first) is sent once a step, as Megatron-LM all-reduces the embedding group's gradient
once after the schedule: the sender sums its term over the micro-batches, sends the sum
before the receiver's task of the last micro-batch, and the receiver reads zeros in its
place in the earlier ones (the parameter's gradient, summed over the micro-batches, is the
same; ``M - 1`` messages fewer).

Micro-batches and the loss: each micro-batch's graph computes its loss as the graph says
(a mean over the micro-batch); the batch's loss is the mean of the ``M`` micro-batch losses
(``loss: mean``, the default; ``sum`` adds them), so each micro-batch's backward is seeded
with the loss cotangent times ``1/M`` and the parameters' gradients are summed over the
micro-batches: exactly the gradient of the whole batch's mean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

from layout_prop.core import meta
from layout_prop.core.errors import GraphError, LayoutPropError, SpecError, cut
from layout_prop.core.graph import Graph, Node
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.redistribute import permute_step
from layout_prop.core.spec import TensorSpec

from layout_prop.io.spec_blocks import PipelineConfig, parse_pipeline  # noqa: F401 (names of this module)

from .lower import LocalOp, Lower, Program, permute_op
from .schedule import Task, schedule, simulate

__all__ = ["PipelineConfig", "micro_batch_graph", "forward_chunks", "assign_positions", "verify_pipeline",
           "lower_pipeline", "PipelineProgram", "Move", "POSITION", "CHUNK", "LAYER", "RankPrograms", "rank_programs",
           "summed_once"]

POSITION = "pipeline_position"  #: node meta: the node's place in a micro-batch's life (see the module docstring)
CHUNK = "pipeline_chunk"  #: node meta: the model chunk whose task runs the node
LAYER = re.compile(r"^l(\d+)_")  #: a decoder layer's nodes are named l<i>_... (the gen generators' convention)


def _bad(message: str, path: str, hint: str) -> SpecError:
    """A ``bad-pipeline`` error at ``path`` of the spec (the cut into chunks, the batch inputs)."""
    return SpecError("bad-pipeline", message, path=path, hint=hint)


# --------------------------------------------------------------------------- the micro-batch graph
def stage_mesh(mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """The mesh one stage runs on: ``mesh`` without ``axis`` (a mesh of that axis alone keeps it, size 1)."""
    keep = [i for i, name in enumerate(mesh.names) if name != axis]
    if not keep:
        return DeviceMesh((1,), (axis,))
    return DeviceMesh(tuple(mesh.shape[i] for i in keep), tuple(mesh.names[i] for i in keep))


#: the operands that hold a model's weights (an embedding's table, a norm's or a linear layer's weight and bias)
WEIGHT_OPERANDS = frozenset({"table", "weight", "bias"})


def _weight_use(graph: Graph, name: str) -> tuple[str, str] | None:
    """``(node, operand)`` of the first node that reads input ``name`` as a weight (:data:`WEIGHT_OPERANDS`)."""
    from layout_prop.core.registry import get_rule

    for node, index in graph.consumers(name):
        try:
            operands = tuple(get_rule(node.op).operands) + tuple(getattr(get_rule(node.op), "optional_operands", ()))
        except LayoutPropError:  # (an op without a rule is reported by the analysis)
            continue
        if index < len(operands) and operands[index] in WEIGHT_OPERANDS:
            return node.name, operands[index]
    return None


def _batch_inputs(graph: Graph, config: PipelineConfig) -> list[str]:
    names = [n.name for n in graph.inputs()]
    if config.batch_inputs is not None:
        for name in config.batch_inputs:
            if name not in names:
                raise _bad(f"batch input {cut(name)} is not a graph input", "pipeline.batch_inputs",
                           f"name inputs of the graph: {', '.join(names[:6])}")
            weight = _weight_use(graph, name)
            if weight is not None:
                raise _bad(f"batch input {cut(name)} is a weight (the {weight[1]} of {weight[0]}): its dim 0 is not "
                           "the batch, cutting it into micro-batches would cut the model", "pipeline.batch_inputs",
                           "name the inputs whose dim 0 is the batch (token ids, labels, activations)")
        return list(config.batch_inputs)
    # default: the integer data inputs without gradient (token ids, labels)
    return [n.name for n in graph.inputs() if not n.attrs.get("requires_grad") and n.attrs.get("shape")
            and not str(n.attrs.get("dtype", "")).startswith(("float", "bfloat"))]


def micro_batch_graph(graph: Graph, config: PipelineConfig) -> tuple[Graph, list[str]]:
    """One micro-batch of ``graph`` on the stage mesh, and the names of the batch inputs.

    Every input's placement on the pipeline axis must be ``R`` (a stage holds whole values
    there); the batch inputs' dim 0 is divided by ``micro_batches``, and so is the first entry
    of a ``shape`` attr that is a multiple of the batch on a node computed from a batch input (a
    reshape of the batch's activations, ``[B, S, ...]`` or the tokens ``[B * S, ...]``; a
    weight's reshape is left alone).

    Raises ``SpecError`` ``bad-pipeline``: an input sharded on the pipeline axis, a batch not
    divisible by the micro-batches, batch inputs of different batch sizes.
    """
    mesh = graph.mesh
    axis = mesh.names.index(config.axis)
    sub = stage_mesh(mesh, config.axis)
    only = mesh.ndim == 1
    batch_names = _batch_inputs(graph, config)
    m = config.micro_batches
    sizes = {name: graph.node(name).attrs["shape"][0] for name in batch_names if graph.node(name).attrs["shape"]}
    batch = None
    if not sizes and m > 1:
        raise _bad(f"no batch input to cut into {m} micro-batches (the default ones are the integer inputs "
                   f"without gradient)", "pipeline.batch_inputs", "name them: batch_inputs: [tokens, labels]")
    if sizes:
        if len(set(sizes.values())) > 1:
            raise _bad(f"the batch inputs disagree on the batch size (dim 0): {sizes}", "pipeline.batch_inputs",
                       "list only the inputs whose dim 0 is the batch")
        batch = next(iter(sizes.values()))
        if batch % m or batch == 0:
            raise _bad(f"a batch of {batch} does not divide into {m} micro-batches", "pipeline.micro_batches",
                       f"use a divisor of {batch} micro-batches, or a batch a multiple of {m}")
    out = Graph(sub)
    for node in graph.inputs():
        attrs = node.attrs
        placements = attrs["placements"]
        if placements != "auto":
            placements = list(placements)
            if str(placements[axis]) != "R":
                raise _bad(f"input {node.name!r} is {placements[axis]} on the pipeline axis {config.axis!r}",
                           f"inputs.{node.name}", f"a stage holds whole values: write R on {config.axis}")
            placements = ["R"] if only else placements[:axis] + placements[axis + 1:]
        shape = attrs["shape"]
        if node.name in sizes and m > 1:
            shape = (shape[0] // m,) + tuple(shape[1:])
        out.input(node.name, shape=shape, dtype=attrs["dtype"], placements=placements,
                  requires_grad=attrs["requires_grad"])
    batched = set(sizes)  # the values computed from a batch input: only their shape attrs hold the batch
    for node in graph.nodes:
        if node.is_input:
            continue
        attrs = dict(node.attrs)
        placements = attrs.get("placements")
        if isinstance(placements, (list, tuple)) and len(placements) == mesh.ndim:  # a redistribute's target
            if str(placements[axis]) != "R":
                raise _bad(f"node {node.name!r} asks for {placements[axis]} on the pipeline axis {config.axis!r}",
                           f"nodes.{node.name}", f"a stage holds whole values: write R on {config.axis}")
            attrs["placements"] = ["R"] if only else list(placements[:axis]) + list(placements[axis + 1:])
        if any(v in batched for v in node.inputs):
            batched.update(node.outputs)
            shape = attrs.get("shape")
            if (batch is not None and m > 1 and isinstance(shape, (list, tuple)) and shape
                    and isinstance(shape[0], int) and shape[0] > 0 and shape[0] % batch == 0):
                attrs["shape"] = [shape[0] // m] + list(shape[1:])  # the batch, or the batch's tokens (B*S)
        out.add_node(Node(node.name, node.op, node.inputs, attrs, node.num_outputs))
    out.output(*graph.outputs)
    return out, [name for name in batch_names if name in sizes]


# --------------------------------------------------------------------------- chunks
def _forward_nodes(graph: Graph) -> list[Node]:
    """The forward op nodes, in graph order (what a spec's nodes are)."""
    return [n for n in graph.nodes if not n.is_input and not n.meta.get(meta.INSERTED_BY)
            and not n.name.startswith("grad/")]


def _units(nodes: list[Node]) -> list[list[str]]:
    """Consecutive groups a boundary may fall between: decoder layers (``l<i>_`` names; the nodes
    before the first layer join it, those after the last join that), else single nodes."""
    layer_of = [LAYER.match(n.name) for n in nodes]
    if not any(layer_of):
        return [[n.name] for n in nodes]
    units: list[list[str]] = []
    current = None
    for node, match in zip(nodes, layer_of):
        layer = int(match.group(1)) if match else None
        if not units or (layer is not None and current is not None and layer != current):
            units.append([])
        if layer is not None:
            current = layer
        units[-1].append(node.name)
    return units


def _balanced(costs: list[float], parts: int) -> list[int]:
    """Start index of each part cutting ``costs`` into ``parts`` consecutive non-empty runs with the
    least largest sum (linear partition: dynamic programming, or on long lists a bisection of the
    largest sum with greedy cuts).

    >>> _balanced([1, 1, 1, 1, 4], 2), _balanced([1.0] * 10, 3)
    ([0, 4], [0, 3, 6])
    """
    n = len(costs)
    if parts * n * n > 2_000_000:
        return _balanced_greedy(costs, parts)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        starts.append(cut[k][j])
        j = cut[k][j]
    return starts[::-1]


def _cuts(costs: list[float], parts: int, limit: float) -> list[int] | None:
    """Greedy starts of at most ``parts`` runs of sums <= ``limit`` (None if more are needed), cut
    early where the runs left must each take one item."""
    starts, total = [0], 0.0
    for i, c in enumerate(costs):
        if i and (total + c > limit or len(costs) - i == parts - len(starts)):
            starts.append(i)
            total = 0.0
            if len(starts) > parts:
                return None
        total += c
    return starts if total <= limit else None


def _balanced_greedy(costs: list[float], parts: int) -> list[int]:
    """:func:`_balanced` in ``O(n log)``: the smallest largest sum by bisection, cut greedily."""
    lo, hi = max(costs), max(sum(costs), max(costs))
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if _cuts(costs, parts, mid) is None:
            lo = mid
        else:
            hi = mid
    starts = _cuts(costs, parts, hi) or list(range(parts))
    return starts


def forward_chunks(graph: Graph, config: PipelineConfig,
                   cost: Callable[[Node], float] | None = None) -> dict[str, int]:
    """The chunk of every forward node: from ``boundaries``, ``layers``, or balanced by ``cost``
    (seconds of a node, e.g. the step-time model's op_time; default: one per node) over layers.

    Raises ``SpecError`` ``bad-pipeline``: more chunks than layers (or nodes), a boundary that is
    not a forward node or out of order, layer counts that do not add up to the layers.
    """
    nodes = _forward_nodes(graph)
    order = {n.name: i for i, n in enumerate(nodes)}
    chunks = config.chunks
    units = _units(nodes)
    what = "layers" if any(LAYER.match(n.name) for n in nodes) else "nodes"
    if chunks > len(units):
        raise _bad(f"{chunks} pipeline chunks ({config.stages} stages x {config.virtual_stages} virtual) for "
                   f"{len(units)} {what}", "pipeline", f"use at most {len(units)} stages, or a deeper model")
    if config.boundaries:
        starts = []
        first_of_layer: dict[int, str] = {}
        for node in nodes:
            match = LAYER.match(node.name)
            if match:
                first_of_layer.setdefault(int(match.group(1)), node.name)
        for k, name in enumerate(config.boundaries):
            if isinstance(name, int):  # a layer index: that layer's first node
                if name not in first_of_layer:
                    raise _bad(f"boundary {name}: the graph has no layer {name} (no node named l{name}_...)",
                               f"pipeline.boundaries[{k}]", f"the layers are {cut(sorted(first_of_layer))}")
                name = first_of_layer[name]
            if name not in order:
                raise _bad(f"boundary {cut(name)} is not a forward node", f"pipeline.boundaries[{k}]",
                           "name the first node of a chunk")
            starts.append(order[name])
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise _bad(f"the boundaries {cut(list(config.boundaries))} are not in graph order after the first node",
                       "pipeline.boundaries", "list the chunks' first nodes in the spec's order")
        starts = [0] + starts
    else:
        unit_start = [order[u[0]] for u in units]
        if config.layers:
            if sum(config.layers) != len(units):
                raise _bad(f"the layer counts {list(config.layers)} add up to {sum(config.layers)}, the model has "
                           f"{len(units)} {what}", "pipeline.layers", f"make them add up to {len(units)}")
            first, starts = 0, []
            for count in config.layers:
                starts.append(unit_start[first])
                first += count
        else:
            node_cost = cost or (lambda node: 1.0)
            by_name = {n.name: n for n in nodes}
            costs = [sum(node_cost(by_name[name]) for name in unit) for unit in units]
            starts = [unit_start[i] for i in _balanced(costs, chunks)]
    out, chunk = {}, -1
    begins = set(starts)
    for i, node in enumerate(nodes):
        if i in begins:
            chunk += 1
        out[node.name] = chunk
    return out


# --------------------------------------------------------------------------- positions and moves
def _origin(name: str) -> str | None:
    """The forward node or value a backward node's name says it comes from: ``grad/X/...`` -> X."""
    if not name.startswith("grad/"):
        return None
    head, sep, _ = name[len("grad/"):].rpartition("/")
    return head if sep else None


def assign_positions(graph: Graph, chunks_of: dict[str, int], config: PipelineConfig) -> dict[str, int]:
    """Every op node's position (module docstring) from the forward chunks, written to its meta
    (``POSITION``, ``CHUNK``).

    A backward node ``grad/X/...`` runs with X's chunk backward (X a forward node, or the node
    making value X); any other node (moves the reshard pass inserted, a gradient's final
    reduction, an input gradient's accumulation) runs in the earliest task of its consumers, or,
    with none placed, the latest of its placed producers, or, with none (it reads only graph inputs:
    a ZeRO re-gather), with its consumers once those are placed, else in the first task.  A sum of a
    value's gradient terms (``grad/X/acc...``) whose terms are all made on one other stage runs there,
    in the latest term's task: a stage input's gradient (its norm's term and its residual's) crosses
    back as one message.
    """
    total = config.chunks
    pos: dict[str, int] = {}
    for node in graph.nodes:
        if node.is_input:
            continue
        if node.name in chunks_of and not node.name.startswith("grad/"):
            pos[node.name] = chunks_of[node.name]
            continue
        origin = _origin(node.name)
        if origin is not None:
            producer = origin.split(":")[0]
            if producer in chunks_of:
                pos[node.name] = 2 * total - 1 - chunks_of[producer]
    consumers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for value in node.inputs:
            consumers.setdefault(value, []).append(node.name)
    order = graph.topo_order()

    def from_consumers() -> None:  # the earliest task among the consumers
        for node in reversed(order):
            if node.is_input or node.name in pos:
                continue
            later = [pos[c] for v in node.outputs for c in consumers.get(v, ()) if c in pos]
            if later:
                pos[node.name] = min(later)

    from_consumers()
    for node in order:  # none: the latest placed producer's task
        if node.is_input or node.name in pos:
            continue
        earlier = [pos[graph.producer(v)[0].name] for v in node.inputs
                   if not graph.producer(v)[0].is_input and graph.producer(v)[0].name in pos]
        if earlier:
            pos[node.name] = max(earlier)
    # a node that reads only graph inputs (a ZeRO re-gather of a weight, named after the weight, not a layer) and
    # whose readers were placed just above by their producers: with its readers, not in task 0 (a move to them)
    from_consumers()
    for node in order:  # none at all (a dead node reading only graph inputs): the first task
        if not node.is_input:
            pos.setdefault(node.name, 0)
    for node in order:  # a sum of gradient terms all made on one other stage: there, one message instead of one a term
        if not _ACCUMULATION.match(node.name) or node.op != "add" or node.meta.get(meta.INSERTED_BY) != "backward":
            continue
        producers = [graph.producer(v)[0] for v in node.inputs]
        if any(p.is_input or p.name not in pos for p in producers):
            continue
        stages = {chunk_of_position(pos[p.name], total) % config.stages for p in producers}
        if len(stages) == 1 and stages != {chunk_of_position(pos[node.name], total) % config.stages}:
            pos[node.name] = max(pos[p.name] for p in producers)
    for node in graph.nodes:
        if not node.is_input:
            node.meta[POSITION] = pos[node.name]
            node.meta[CHUNK] = chunk_of_position(pos[node.name], total)
    return pos


#: the backward pass's sum of a value's gradient terms (passes/backward.py ``_total``): grad/VALUE/accaddN
_ACCUMULATION = re.compile(r"^grad/.+/acc[^/]*$")


def chunk_of_position(position: int, chunks: int) -> int:
    """The chunk whose forward (position < C) or backward task a position is."""
    return position if position < chunks else 2 * chunks - 1 - position


def _phase(position: int, chunks: int) -> str:
    return "F" if position < chunks else "B"


@dataclass(frozen=True)
class Move:
    """A value sent from ``src_stage`` to ``dst_stage`` before task ``(chunk, phase)`` of the receiver."""

    value: str
    src_stage: int
    dst_stage: int
    chunk: int
    phase: str

    @property
    def shift(self) -> int:
        return self.dst_stage - self.src_stage


def pipeline_moves(graph: Graph, config: PipelineConfig) -> list[Move]:
    """One ``Move`` per value a stage reads from another stage, received once per micro-batch, before
    the first task of the receiver that reads it (graph inputs are every stage's own)."""
    total, p = config.chunks, config.stages
    received: dict[tuple[str, int], int] = {}  # (value, stage) -> earliest position reading it
    source: dict[tuple[str, int], int] = {}
    for node in graph.nodes:
        if node.is_input:
            continue
        here = node.meta[POSITION]
        stage = node.meta[CHUNK] % p
        for value in node.inputs:
            producer = graph.producer(value)[0]
            if producer.is_input:
                continue
            src = producer.meta[CHUNK] % p
            if src != stage and here < received.get((value, stage), 1 << 30):
                received[(value, stage)] = here
                source[(value, stage)] = src
    return [Move(value, source[(value, stage)], stage, chunk_of_position(here, total), _phase(here, total))
            for (value, stage), here in sorted(received.items(), key=lambda kv: (kv[1], kv[0]))]


#: ops whose output is linear in each input: a sum of gradient terms, or a layout change (a reduction of partial sums)
_LINEAR_OPS = frozenset({"add", "redistribute", "identity"})
#: the partial reductions a linear layout change may hold (a max or min of terms is not linear)
_LINEAR_REDUCTIONS = frozenset({"sum", "avg"})


def _linear_specs(node: Node) -> bool:
    """Whether none of ``node``'s outputs is a partial max or min (its reduction would not be linear)."""
    for spec in node.meta.get(meta.SPECS) or ():
        layout = getattr(spec, "layout", None)
        for placement in (layout.placements if layout is not None else ()):
            if placement.is_partial() and placement.reduce_op not in _LINEAR_REDUCTIONS:
                return False
    return True


def summed_once(graph: Graph, move: Move, grads: set[str], stages: int) -> bool:
    """Whether ``move`` may be sent once a step, its sender's sum over the micro-batches (module docstring).

    It may when the value is a backward node's (a gradient term) and everything computed from it runs on
    the receiving stage through sums and layout changes (``add``, ``redistribute``, ``identity``: linear)
    and ends only in parameters' gradients (``grads``, summed over the micro-batches): each of those is then
    linear in the value, and the receiver reading the sender's sum in its last micro-batch and zeros in the
    others gives the same sum over the micro-batches.  A tied embedding's gradient term from the head is
    such a value (it is added to the embedding's own term, then reduced).
    """
    producer = graph.producer(move.value)[0]
    if producer.is_input or producer.meta.get(meta.INSERTED_BY) != "backward" or not _linear_specs(producer):
        return False
    outputs = set(graph.outputs)
    frontier, seen = [move.value], set()
    while frontier:
        value = frontier.pop()
        if value in outputs and value not in grads:
            return False
        for node, _ in graph.consumers(value):
            if node.name in seen:
                continue
            seen.add(node.name)
            if (node.op not in _LINEAR_OPS or node.meta[CHUNK] % stages != move.dst_stage
                    or not _linear_specs(node)):
                return False
            frontier.extend(node.outputs)
    return True


def verify_pipeline(graph: Graph, moves: list[Move], config: PipelineConfig) -> None:
    """Every edge runs forward in a micro-batch's life (the producer's task no later than the
    consumer's) and crosses stages only through a move received by the consumer's task or earlier.

    Raises ``GraphError`` ``pipeline-order`` or ``pipeline-missing-move``.
    """
    p = config.stages
    have = {(mv.value, mv.dst_stage): 2 * config.chunks - 1 - mv.chunk if mv.phase == "B" else mv.chunk
            for mv in moves}
    for node in graph.nodes:
        if node.is_input:
            continue
        for value in node.inputs:
            producer = graph.producer(value)[0]
            if producer.is_input:
                continue
            if producer.meta[POSITION] > node.meta[POSITION]:
                raise GraphError("pipeline-order", f"{node.name!r} (position {node.meta[POSITION]}) reads "
                                 f"{value!r}, made later (position {producer.meta[POSITION]})", node=node.name,
                                 input=value, hint="a chunk may read only earlier chunks' forward values")
            src, dst = producer.meta[CHUNK] % p, node.meta[CHUNK] % p
            if src != dst and have.get((value, dst), 1 << 30) > node.meta[POSITION]:
                raise GraphError("pipeline-missing-move", f"{value!r} crosses from stage {src} to stage {dst} "
                                 f"without a move", node=node.name, input=value,
                                 hint="run pipeline_moves after the last pass that changes the graph")


# --------------------------------------------------------------------------- the program
@dataclass
class PipelineProgram:
    """Each rank's pipelined program: the stage mesh's SPMD ``program`` cut into tasks.

    ``tasks[(chunk, phase)]`` are the local ops of that task (in program order), ``inputs`` the
    input ops, ``moves`` the values each task receives first (every micro-batch), ``step_moves`` those
    it receives once a step, before its last micro-batch (the sender's sum over the micro-batches; zeros
    stand in before: :func:`summed_once`), ``orders[s]`` stage s's schedule,
    ``batch_inputs`` the inputs cut into micro-batches, ``grads`` the parameters' gradients
    (summed over micro-batches), ``outputs`` the other outputs (scalars: ``config.loss`` over
    micro-batches; others, a batch input's gradient too, concatenated along dim 0).
    """

    mesh: DeviceMesh
    config: PipelineConfig
    program: Program
    tasks: dict[tuple[int, str], list[LocalOp]]
    inputs: list[LocalOp]
    moves: dict[tuple[int, str], list[Move]]
    orders: list[list[Task]]
    batch_inputs: list[str]
    grads: list[str]
    outputs: list[str]
    stage_inputs: dict[int, list[str]] = field(default_factory=dict)
    run_order: list[tuple[int, Task]] = field(default_factory=list)  # every (stage, task), dependencies first
    step_moves: dict[tuple[int, str], list[Move]] = field(default_factory=dict)  # received once, summed

    @property
    def axis(self) -> int:
        return self.mesh.names.index(self.config.axis)

    def micro_batch_op(self, op: LocalOp, k: int) -> LocalOp:
        """``op`` as micro-batch ``k`` runs it (:func:`micro_batch_op`: its random draws are those of
        its rows of the whole batch)."""
        return micro_batch_op(op, k, self.config.micro_batches)

    def stage_of(self, rank: int) -> int:
        return self.mesh.coords(rank)[self.axis]

    def stage_rank(self, rank: int) -> int:
        """The rank's index on the stage mesh."""
        coords = list(self.mesh.coords(rank))
        del coords[self.axis]
        return self.program.mesh.rank(coords) if coords else 0

    def rank_at(self, stage: int, stage_rank: int) -> int:
        """The rank of the whole mesh at ``stage`` and stage-mesh rank ``stage_rank``."""
        coords = list(self.program.mesh.coords(stage_rank)) if self.mesh.ndim > 1 else []
        coords.insert(self.axis, stage)
        return self.mesh.rank(coords)

    def lift(self, spec: TensorSpec) -> TensorSpec:
        """A stage-mesh spec on the whole mesh, ``R`` on the pipeline axis."""
        placements = [str(p) for p in spec.layout.placements]
        if self.mesh.ndim == 1:
            placements = ["R"]
        else:
            placements.insert(self.axis, "R")
        return TensorSpec(spec.shape, spec.dtype, Layout(self.mesh, placements, len(spec.shape)))

    def permute(self, move: Move):
        """The ``permute`` step of a move, on the whole mesh."""
        spec = self.lift(self.program.specs[move.value])
        return permute_step(spec, self.axis, move.shift)

    def move_op(self, move: Move) -> LocalOp:
        """The lowered ``collective`` op of a move: a ``permute`` on the whole mesh."""
        return permute_op(move.value, self.permute(move), move.value, f"pipeline:{move.value}")

    def receives(self, key: tuple[int, str]) -> list[tuple[Move, bool]]:
        """The moves task ``key`` receives, each with whether it is received once a step."""
        return ([(mv, False) for mv in self.moves.get(key, ())]
                + [(mv, True) for mv in self.step_moves.get(key, ())])

    def task_names(self, stage: int) -> list[str]:
        return [str(t) for t in self.orders[stage]]

    def to_dict(self, rank: int) -> dict:
        """Rank ``rank``'s program as JSON-ready data: its stage, its schedule (``[micro-batch, chunk,
        forward|backward]`` in order), and per task of its chunks the values it receives (with the
        permute step; ``once_a_step``: the sender's sum, before the last micro-batch) and its local ops
        (:meth:`Program.op_dict` on the stage mesh)."""
        stage, q = self.stage_of(rank), self.stage_rank(rank)
        c = self.config
        tasks = []
        for chunk in range(stage, c.chunks, c.stages):
            for phase in "FB":
                receives = [{"value": mv.value, "from_rank": self.rank_at(mv.src_stage, q), "once_a_step": once,
                             **self.permute(mv).to_dict()} for mv, once in self.receives((chunk, phase))]
                ops = [self.program.op_dict(op, q) for op in self.tasks.get((chunk, phase), ())]
                tasks.append({"chunk": chunk, "phase": "forward" if phase == "F" else "backward",
                              "receives": receives, "ops": ops})
        return {"rank": rank, "coords": list(self.mesh.coords(rank)), "stage": stage, "stage_rank": q,
                "schedule": c.schedule, "micro_batches": c.micro_batches,
                "order": [t.to_list() for t in self.orders[stage]], "tasks": tasks}

    def format(self, rank: int) -> str:
        """Rank ``rank``'s program: its stage, schedule, and per task the moves in and the local ops."""
        stage, q = self.stage_of(rank), self.stage_rank(rank)
        c = self.config
        lines = [f"rank {rank} of {self.mesh}: stage {stage} of {c.stages} (stage-mesh rank {q}), "
                 f"{c.schedule} over {c.micro_batches} micro-batches",
                 "  schedule: " + " ".join(self.task_names(stage))]
        chunks = [stage + j * c.stages for j in range(c.virtual_stages)]
        for phase in "FB":
            for chunk in (chunks if phase == "F" else chunks[::-1]):
                lines.append(f"  task {'forward' if phase == 'F' else 'backward'} chunk {chunk}:")
                for mv, once in self.receives((chunk, phase)):
                    step = self.permute(mv)
                    peer = self.rank_at(mv.src_stage, q)
                    when = (f", once a step: in micro-batch {c.micro_batches - 1}, the sum over the micro-batches "
                            f"(zeros before)" if once else "")
                    lines.append(f"    {mv.value} = collective() permute on {c.axis} shift {mv.shift}: recv from "
                                 f"{peer}, {step.bytes_per_rank} bytes{when}")
                sub = Program(self.program.mesh, list(self.tasks.get((chunk, phase), ())))
                lines.extend("  " + line for line in sub.format(q).splitlines()[1:])
        sends = [(mv, False) for mvs in self.moves.values() for mv in mvs if mv.src_stage == stage]
        sends += [(mv, True) for mvs in self.step_moves.values() for mv in mvs if mv.src_stage == stage]
        for mv, once in sends:
            what = f"the sum of {mv.value} over the micro-batches, once a step," if once else mv.value
            task = f"{'forward' if mv.phase == 'F' else 'backward'} chunk {mv.chunk}"
            lines.append(f"  send {what} to stage {mv.dst_stage} (rank {self.rank_at(mv.dst_stage, q)}) before its "
                         + (f"last micro-batch's {task}" if once else task))
        return "\n".join(lines)


def micro_batch_op(op: LocalOp, k: int, m: int) -> LocalOp:
    """``op`` as micro-batch ``k`` of ``m`` runs it: a random op (dropout, multinomial: localised
    ``offsets`` and ``global_shape``; flash attention's dropout: ``b_start`` and ``b_total``) draws
    what one device draws for those rows of the whole batch, so a pipelined run with dropout on
    equals one device on the whole batch.

    The draws are keyed by an element's global row-major index (``kernels/loss_numpy.py``
    ``counter_uniform``); a micro-batch's graph has dim 0 the batch cut ``m`` ways (or the tokens
    ``[B * S, ...]``, batch-major), so its row ``r`` is row ``k * rows + r`` of the whole batch,
    whose dim 0 is ``m * rows``.  Other ops are returned as they are.
    """
    if k == 0 and m == 1 or op.kind != "kernel" or not op.attrs:
        return op
    first = op.attrs[0]
    if "offsets" in first and "global_shape" in first and first["global_shape"]:
        def shifted(attrs: dict) -> dict:
            rows = attrs["global_shape"][0]
            return {**attrs, "offsets": [attrs["offsets"][0] + k * rows, *attrs["offsets"][1:]],
                    "global_shape": [rows * m, *attrs["global_shape"][1:]]}
    elif "b_start" in first and "b_total" in first:
        def shifted(attrs: dict) -> dict:
            return {**attrs, "b_start": attrs["b_start"] + k * attrs["b_total"], "b_total": attrs["b_total"] * m}
    else:
        return op
    return replace(op, attrs=tuple(shifted(attrs) for attrs in op.attrs))


def lower_pipeline(graph: Graph, config: PipelineConfig, mesh: DeviceMesh, batch_inputs: list[str],
                   chunks_of: dict[str, int], localize: bool = True) -> PipelineProgram:
    """Lower an analysed micro-batch graph (stage mesh, backward and reshard done) to the program of
    every rank of ``mesh`` (the whole mesh, with the pipeline axis): positions, moves, verification,
    the stage mesh's SPMD program cut by task, the schedule of every stage.  ``localize=False``: no
    per-rank kernel attrs (:class:`~layout_prop.passes.lower.Lower`), for analyses that execute nothing
    (estimate: a 405B Llama's 1,024-rank stage mesh spent most of its time localizing)."""
    assign_positions(graph, chunks_of, config)
    moves = pipeline_moves(graph, config)
    verify_pipeline(graph, moves, config)
    # the parameters' gradients are summed over micro-batches; a batch input's gradient, like a forward
    # output, is one piece per micro-batch (concatenated along dim 0)
    grads = [v for v in graph.outputs if graph.producer(v)[0].meta.get(meta.GRAD_OF) not in (None, *batch_inputs)]
    outputs = [v for v in graph.outputs if v not in grads]
    program = Lower(localize=localize).run(graph).program
    position = {n.name: n.meta[POSITION] for n in graph.nodes if not n.is_input}
    tasks: dict[tuple[int, str], list[LocalOp]] = {}
    inputs: list[LocalOp] = []
    stage_inputs: dict[int, set[str]] = {}
    input_names = {n.name for n in graph.inputs()}
    for op in program.ops:
        if op.kind == "input":
            inputs.append(op)
            continue
        here = position[op.source]
        chunk = chunk_of_position(here, config.chunks)
        tasks.setdefault((chunk, _phase(here, config.chunks)), []).append(op)
        for value in op.inputs:
            if value in input_names:
                stage_inputs.setdefault(chunk % config.stages, set()).add(value)
    by_task: dict[tuple[int, str], list[Move]] = {}
    once: dict[tuple[int, str], list[Move]] = {}
    summed = set(grads)
    for mv in moves:
        (once if summed_once(graph, mv, summed, config.stages) else by_task).setdefault((mv.chunk, mv.phase),
                                                                                        []).append(mv)
    orders = schedule(config.schedule, config.stages, config.micro_batches, config.virtual_stages)
    run_order = simulate(orders, config.stages, config.virtual_stages).order()
    return PipelineProgram(mesh, config, program, tasks, inputs, by_task, orders, list(batch_inputs), grads,
                           outputs, {s: sorted(v) for s, v in stage_inputs.items()}, run_order, once)



# --------------------------------------------------------------------------- one op list per rank
def _renamed(value: str, k: int, shared: set[str]) -> str:
    return value if value in shared else f"{value}@mb{k}"


@dataclass
class RankPrograms:
    """A pipelined program written out per rank on the whole mesh, for engines that run one rank a
    process (msrun): :meth:`rank_ops` is rank ``r``'s own op list, every value of micro-batch ``k``
    named ``VALUE@mbK``, every spec and step lifted to the whole mesh (``R`` on the pipeline axis).

    The list walks the timed schedule (``run_order``): before each task every rank takes part
    in each move's ``permute`` on the pipeline axis (its group spans every stage: the sender
    gives its piece, the other members a zero placeholder input ``pipeline/zeros/...``; only
    the receiver keeps the result), then the ranks of the task's stage run its ops.  A move once a
    step (:attr:`PipelineProgram.step_moves`) is such a ``permute`` before the task's last micro-batch,
    of the sender's sum (``VALUE@sumK``, ``add`` kernels); in the earlier micro-batches the receiver
    reads a zero placeholder (``pipeline/zeros/VALUE@mbK``, through ``identity``).  At the end
    each gradient is summed over the micro-batches with ``add`` kernels into its own name.
    A rank that does not hold a wanted value reads a zero placeholder for it.  ``ops``,
    ``specs``, ``collectives`` and ``outputs`` are what the msrun launcher reads (it cuts every
    input op of ``ops`` for every rank; a rank reads only its own).
    """

    pipeline: PipelineProgram
    ops: list[LocalOp] = field(default_factory=list)
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    per_rank: list[list[LocalOp]] = field(default_factory=list)
    holders: dict[str, int] = field(default_factory=dict)  # wanted value -> the stage whose ranks hold it

    @property
    def mesh(self) -> DeviceMesh:
        return self.pipeline.mesh

    @property
    def collectives(self) -> list[LocalOp]:
        return [op for op in self.ops if op.kind == "collective"]

    def rank_ops(self, rank: int) -> list[LocalOp]:
        return self.per_rank[rank]

    def wanted(self) -> list[str]:
        """The values to bring back: every gradient (summed) and each forward output per micro-batch."""
        pp = self.pipeline
        return list(pp.grads) + [f"{v}@mb{k}" for v in pp.outputs for k in range(pp.config.micro_batches)]

    def placeholder_inputs(self) -> dict:
        """Global zeros for every placeholder input (``pipeline/zeros/...``, ``pipeline/absent/...``):
        add them to the global inputs given to the engine."""
        import numpy as np

        from layout_prop.core.spec import numpy_dtype

        return {op.name: np.zeros(op.specs[0].shape, numpy_dtype(op.specs[0].dtype)) for op in self.ops
                if op.kind == "input" and op.name.startswith("pipeline/")}


def rank_programs(pprog: PipelineProgram) -> RankPrograms:
    """Write ``pprog`` out per rank on the whole mesh (:class:`RankPrograms`)."""
    from dataclasses import replace

    mesh, config = pprog.mesh, pprog.config
    m = config.micro_batches
    shared = {op.name for op in pprog.inputs if op.name not in pprog.batch_inputs}
    out = RankPrograms(pprog)
    union: dict[str, LocalOp] = {}

    def lift_op(op: LocalOp, rename) -> LocalOp:
        step = op.step
        if step is not None and step.src.mesh != mesh:
            axis = step.mesh_axis if mesh.ndim == 1 else step.mesh_axis + (step.mesh_axis >= pprog.axis)
            step = replace(step, mesh_axis=axis, src=pprog.lift(step.src), dst=pprog.lift(step.dst))
        attrs = tuple(op.attrs[pprog.stage_rank(r)] for r in range(mesh.size)) if op.attrs else ()
        specs = tuple(pprog.lift(s) if s.mesh != mesh else s for s in op.specs)
        return replace(op, name=rename(op.name), inputs=tuple(rename(v) for v in op.inputs),
                       outputs=tuple(rename(v) for v in op.outputs), specs=specs, attrs=attrs, step=step)

    def add(rank_list: list[LocalOp], op: LocalOp) -> None:
        rank_list.append(op)
        for value, spec in zip(op.outputs, op.specs):
            out.specs[value] = spec
        union.setdefault(op.name, op)

    def placeholder(name: str, spec: TensorSpec) -> LocalOp:
        return LocalOp(name, "input", "input", (), (name,), (spec,))

    input_spec = {op.name: op.specs[0] for op in pprog.inputs}
    holders = out.holders
    for rank in range(mesh.size):
        ops: list[LocalOp] = []
        stage = pprog.stage_of(rank)
        for name in pprog.stage_inputs.get(stage, ()):
            for k in (range(m) if name in pprog.batch_inputs else [None]):
                local = name if k is None else f"{name}@mb{k}"
                add(ops, placeholder(local, pprog.lift(input_spec[name])))
        for task_stage, task in pprog.run_order:
            k = task.micro_batch
            key = (task.chunk, task.phase)
            for move, once in pprog.receives(key):
                value = f"{move.value}@mb{k}"
                op = pprog.move_op(move)
                if once and k < m - 1:  # no message: the receiver reads zeros (the sum arrives in the last)
                    if stage == move.dst_stage:
                        zeros = f"pipeline/zeros/{value}"
                        add(ops, placeholder(zeros, op.specs[0]))
                        add(ops, LocalOp(f"pipeline/zero-id/{value}", "kernel", "identity", (zeros,), (value,),
                                         (op.specs[0],), tuple({} for _ in range(mesh.size)), source=move.value))
                    continue
                if stage == move.src_stage:
                    source = value
                    if once:  # the sender's sum over the micro-batches
                        source = f"{move.value}@mb0"
                        for j in range(1, m):
                            total = f"{move.value}@sum{j}"
                            add(ops, LocalOp(total, "kernel", "add", (source, f"{move.value}@mb{j}"), (total,),
                                             (op.specs[0],), tuple({} for _ in range(mesh.size)), source=move.value))
                            source = total
                else:
                    source = f"pipeline/zeros/{value}"
                    add(ops, placeholder(source, op.specs[0]))
                target = value if stage == move.dst_stage else f"pipeline/dropped/{value}"
                add(ops, replace(op, name=target, inputs=(source,), outputs=(target,)))
            if task_stage != stage:
                continue
            for op in pprog.tasks.get(key, ()):
                add(ops, lift_op(pprog.micro_batch_op(op, k), lambda v, k=k: _renamed(v, k, shared)))
        made = {v for op in ops for v in op.outputs}
        for value in pprog.outputs:
            if f"{value}@mb0" in made:
                holders.update({f"{value}@mb{k}": stage for k in range(m)})
        for grad in pprog.grads:
            if f"{grad}@mb0" not in made:
                continue
            holders[grad] = stage
            total = f"{grad}@mb0"
            spec = out.specs[total]
            for k in range(1, m):
                name = grad if k == m - 1 else f"{grad}@acc{k}"
                attrs = tuple({} for _ in range(mesh.size))
                add(ops, LocalOp(name, "kernel", "add", (total, f"{grad}@mb{k}"), (name,), (spec,), attrs,
                                 source=grad))
                total = name
            if m == 1:
                out.outputs[grad] = total  # (the wanted name maps to the one micro-batch's value)
        out.per_rank.append(ops)
    for rank in range(mesh.size):  # placeholders for the wanted values a rank does not hold
        made = {v for op in out.per_rank[rank] for v in op.outputs}
        for value in out.wanted():
            local = out.outputs.get(value, value)
            if local not in made:
                spec = out.specs[local]
                name = f"pipeline/absent/{value}"
                add(out.per_rank[rank], placeholder(name, spec))
                out.per_rank[rank].append(LocalOp(f"pipeline/absent-id/{value}", "kernel", "identity", (name,),
                                                  (local,), (spec,), tuple({} for _ in range(mesh.size))))
    out.ops = list(union.values())
    return out
