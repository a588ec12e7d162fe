"""A training step's time on a cluster: compute, exposed communication, the optimizer.

The input is a graph analysed with its backward and resharded
(``analyze(graph, reshard=True, backward=True)``): every op with its local shapes, every
redistribution as ``redistribute`` nodes with their collective steps.  The spec's graph is
one micro-batch on all ranks (its batch dim is the micro-batch times the data-parallel
degree).  The model, per step, for the busiest rank (rank 0: torch.chunk gives the first
pieces the larger share, so rank 0 holds the largest piece of every uneven shard):

- compute: every op's roofline time (:mod:`.costs`), forward and backward, times the
  accumulation steps ``global_batch / (micro_batch x dp)``; ``recompute="full"`` adds the
  forward of the numbered layers once more (their ops and collectives: :func:`layer_nodes`;
  the embedding, head and loss are not recomputed), as Megatron-LM's full activation
  recomputation does (the whole forward when no node is named with a layer number);
  ``recompute="selective"`` (or ``"full"`` with ``recompute_layers``) applies :class:`~layout_prop.passes.recompute.Recompute` and counts its copies, the
  recomputed segments' forward (their collectives are exposed with the backward's), and the
  memory figure then frees what they recompute;
- communication: each collective step of each redistribution priced by algorithm on the
  links its mesh axis spans (:mod:`.collectives`). Steps inside the forward and the
  backward are exposed (tensor, sequence and context parallel collectives wait for their
  result); the data-parallel gradient synchronisation (the redistributions that make a
  parameter's gradient) runs once a step, after the last micro-batch's backward, bucketed
  and overlapped with that backward: exposed is what the backward cannot hide, and at
  least the last bucket (the gradient made last); ``overlap=False`` exposes all of it.  A
  parameter stored sharded and gathered where it is read (a plan's layout, not ``zero=``) has
  its cotangent moved back to that layout in each micro-batch's backward (FSDP's
  reduce-scatter): overlapped with that micro-batch's backward, as the solver prices it.  An
  op that is communication (a ring attention's ``ring_shift``: its rule's ``comm_steps``, a
  cyclic permute) is priced as its steps, all exposed: no overlap of a ring's permutes with
  its blocks' compute is modelled;
- the gradient accumulation: with more than one micro-batch a step, each micro-batch after the
  first adds its weight gradients into the accumulated ones (read both, write one: three times
  the gradients' bytes through HBM, :func:`~layout_prop.perf.parallel.accumulation_time`),
  counted in the backward (autograd accumulates there);
- the optimizer: AdamW reads the gradient, the parameter and two states and writes the parameter
  and the states, the parameter and states in float32 (a master copy of a 16-bit parameter, its
  16-bit copy written too): 28 bytes a parameter through HBM for float32 and 16-bit models alike
  (:func:`~layout_prop.perf.parallel.optimizer_bytes_per_param`).

ZeRO (``zero``, a :class:`~layout_prop.passes.zero.ZeroConfig`; the graph transformed by
:class:`~layout_prop.passes.zero.Zero` and finished by :func:`~layout_prop.passes.zero.finish`):
the optimizer updates a shard (its time divided by the ZeRO degree); stages 1 and 2 reduce-
scatter the gradients (the ``grad/NAME`` moves) and all-gather the updated parameters after
the optimizer (priced from each parameter's shard to its layout, exposed: the backward is
over); stages 2 and 3 reduce-scatter every micro-batch (gradients are not accumulated whole),
each micro-batch's data-parallel traffic overlapped with its backward (stage 2), exposed at
least the last reduce-scatter; stage 3 prefetches each gather one layer ahead, so the
``zero/gather`` all-gathers hide behind the forward's compute only and the ``zero/regather``
ones and the reduce-scatters behind the backward's and the recomputation's, exposed at least
the first gather and the last reduce-scatter
(:func:`~layout_prop.perf.parallel.zero3_exposed`).  The memory figure
is :class:`~layout_prop.passes.memory.Memory` with the ZeRO paper's convention.

The data-parallel degree is the product of the sizes of the mesh axes named ``dp``
(or ``data``, ``fsdp``).

FLOPs: ``flops_per_step`` is the exact count of the graph's ops on rank 0 times the mesh
size (the FLOPs the step executes, recomputation included); ``tflops_per_device`` and
``mfu`` divide it by the step time, the devices and the peak of the model's dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from layout_prop.core import meta
from layout_prop.core.errors import SpecError
from layout_prop.core.graph import Graph
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.passes.memory import Memory
from layout_prop.passes.propagate import value_spec

from layout_prop.io.spec_blocks import TrainingBlock, parse_training  # noqa: F401 (re-exported)

from .calibration import CALIBRATION
from .clusters import Cluster
from .collectives import collective_time
from .costs import cost_class, op_cost, op_time
from .parallel import accumulation_time, optimizer_time, zero3_exposed

__all__ = ["StepEstimate", "estimate_step", "DATA_AXES", "RECOMPUTE", "TrainingBlock", "parse_training",
           "layer_nodes"]

DATA_AXES = ("dp", "data", "fsdp")
RECOMPUTE = ("none", "selective", "full")


@dataclass
class StepEstimate:
    """What :func:`estimate_step` returns (times in seconds)."""

    cluster: str
    devices: int
    accumulation: int
    forward_s: float
    backward_s: float
    recompute_s: float
    communication: dict[str, dict[str, float]]  # mesh axis -> kind -> exposed seconds per step
    grad_sync_s: float
    grad_sync_exposed_s: float
    optimizer_s: float
    flops_per_step: float
    peak_flops: float
    memory_per_rank_bytes: int
    hbm_bytes: int
    top_ops: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    zero_stage: int = 0
    zero_gather_s: float = 0.0  # ZeRO's parameter all-gathers a step (in grad_sync_s too)
    forward_comm_s: float = 0.0  # of the exposed collectives, the forward's (a step's)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s

    @property
    def communication_s(self) -> float:
        """Exposed communication: the forward and backward collectives and the exposed gradient sync."""
        return sum(sum(kinds.values()) for kinds in self.communication.values()) + self.grad_sync_exposed_s

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.communication_s + self.optimizer_s

    @property
    def tflops_per_device(self) -> float:
        return self.flops_per_step / self.step_time_s / self.devices / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.tflops_per_device * 1e12 / self.peak_flops if self.peak_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster, "devices": self.devices, "accumulation_steps": self.accumulation,
            "step_time_s": self.step_time_s, "compute_s": self.compute_s, "communication_s": self.communication_s,
            "optimizer_s": self.optimizer_s, "tflops_per_device": self.tflops_per_device, "mfu": self.mfu,
            "flops_per_step": self.flops_per_step, "memory_per_rank_bytes": self.memory_per_rank_bytes,
            "breakdown": {
                "forward_s": self.forward_s, "backward_s": self.backward_s, "recompute_s": self.recompute_s,
                "communication_exposed_s": self.communication,
                "grad_sync_s": self.grad_sync_s, "grad_sync_exposed_s": self.grad_sync_exposed_s,
                "optimizer_s": self.optimizer_s, "zero_stage": self.zero_stage, "zero_gather_s": self.zero_gather_s,
            },
            "top_ops": self.top_ops, "notes": self.notes, "model_error": CALIBRATION.to_dict(),
        }


def data_parallel_degree(mesh) -> int:
    return math.prod(n for n, name in zip(mesh.shape, mesh.names) if name in DATA_AXES)


def accumulation_steps(mesh, global_batch: int | None, micro_batch: int | None) -> int:
    """``global_batch / (micro_batch x dp)``, checked; 1 when neither is given."""
    if global_batch is None and micro_batch is None:
        return 1
    if global_batch is None or micro_batch is None:
        raise SpecError("bad-value", "--global-batch and --micro-batch go together",
                        hint="give both: the spec's graph is one micro-batch on every data-parallel rank")
    dp = data_parallel_degree(mesh)
    if global_batch % (micro_batch * dp):
        raise SpecError("bad-value", f"global batch {global_batch} is not a multiple of micro-batch {micro_batch} x "
                        f"data-parallel degree {dp}", hint="the accumulation steps global / (micro x dp) must be whole")
    return global_batch // (micro_batch * dp)


#: a node named with a layer number: ``l3_q``, ``transformer.h.3.attn.c_attn`` (the search's recognition of layers)
_NUMBERED = re.compile(r"^(.*?\D|)(\d+)(\D.*)$")


def layer_nodes(graph: Graph) -> set[str]:
    """The forward nodes of the model's numbered layers: the nodes named with a number after a common prefix, the
    prefix with the most numbers (``planner.search.recognise``'s rule); empty when no name carries one.  What full
    recomputation redoes: the layers, not the embedding, the head or the loss around them.

    >>> from layout_prop.io.loader import load_spec
    >>> g = load_spec({"mesh": {"shape": [1], "names": ["dp"]}, "inputs": {"x": {"shape": [2], "dtype": "float32",
    ...                "placements": ["R"]}}, "nodes": [{"name": "l0_a", "op": "neg", "inputs": ["x"]},
    ...                {"name": "l1_a", "op": "neg", "inputs": ["l0_a"]}, {"name": "head", "op": "neg",
    ...                "inputs": ["l1_a"]}], "outputs": ["head"]})
    >>> sorted(layer_nodes(g))
    ['l0_a', 'l1_a']
    """
    groups: dict[str, dict[int, list[str]]] = {}
    for node in graph.nodes:
        if node.is_input or node.name.startswith("grad/") or node.meta.get(meta.INSERTED_BY) in ("backward",
                                                                                                "recompute"):
            continue
        hit = _NUMBERED.match(node.name)
        if hit:
            groups.setdefault(hit.group(1), {}).setdefault(int(hit.group(2)), []).append(node.name)
    if not groups:
        return set()
    prefix = max(groups, key=lambda k: (len(groups[k]), sum(map(len, groups[k].values()))))
    return {name for names in groups[prefix].values() for name in names}


def _makes_gradient(graph: Graph, node, params: set[str]) -> bool:
    """Whether the backward move ``node`` takes a parameter's cotangent to what becomes the parameter's gradient
    (read only by the node that is the gradient, ``meta["grad_of"]``, or by the sums into it): the way back of a
    parameter gathered where it is read, which the solver overlaps with the backward as the gradient's
    synchronisation is (:class:`~layout_prop.planner.solver.Problem`)."""
    frontier, seen = [node], set()
    while frontier:
        current = frontier.pop()
        readers = [reader for value in current.outputs for reader, _ in graph.consumers(value)]
        if not readers:
            return False
        for reader in readers:
            if reader.meta.get(meta.GRAD_OF) in params:
                continue
            if reader.name in seen or reader.op not in ("add", "identity") or not reader.name.startswith("grad/"):
                return False
            seen.add(reader.name)
            frontier.append(reader)
    return True


def _phase(graph: Graph, node) -> str:
    if node.meta.get(meta.INSERTED_BY) == "recompute":
        return "recompute"
    if node.name.startswith("zero/regather/"):  # ZeRO-3's gather for the backward
        return "backward"
    if node.meta.get(meta.INSERTED_BY) == "backward" or node.name.startswith("grad/"):
        return "backward"
    if node.op == "redistribute":
        consumer = node.meta.get(meta.FOR, (None,))[0]
        if consumer is not None and consumer in graph and \
                graph.node(consumer).meta.get(meta.INSERTED_BY) == "backward":
            return "backward"
    return "forward"


def _comm_steps(node, attrs: dict, inputs, outputs, rules: dict) -> tuple:
    """The steps of an op that is communication (its rule's ``comm_steps``), else ()."""
    if node.op not in rules:
        from layout_prop.core.registry import get_rule

        rule = get_rule(node.op)
        rules[node.op] = rule if rule.is_communication else None
    rule = rules[node.op]
    return () if rule is None else tuple(rule.comm_steps(attrs, tuple(inputs), tuple(outputs)))


def estimate_step(graph: Graph, cluster: Cluster, *, global_batch: int | None = None,
                  micro_batch: int | None = None, recompute: str = "none", overlap: bool = True,
                  zero=None, recompute_layers=None) -> StepEstimate:
    """The modelled step of ``graph`` (analysed with backward and reshard) on ``cluster``."""
    if recompute not in RECOMPUTE:
        raise SpecError("bad-value", f"unknown recompute {recompute!r}", hint=f"use one of {', '.join(RECOMPUTE)}")
    if recompute == "selective" or (recompute == "full" and recompute_layers is not None):
        from layout_prop.passes.recompute import Recompute

        graph = Recompute(recompute, recompute_layers).run(graph)
        recompute = "copies"
    stage = zero.stage if zero is not None else 0
    mesh = graph.mesh
    devices = mesh.size
    if cluster.nodes is not None and devices > cluster.nodes * cluster.devices_per_node:
        raise SpecError("mesh-too-large", f"the mesh has {devices:,} devices, cluster {cluster.name!r} "
                        f"{cluster.nodes * cluster.devices_per_node:,} ({cluster.nodes} nodes of "
                        f"{cluster.devices_per_node})", hint="use a smaller mesh or a larger cluster (its nodes)")
    acc = accumulation_steps(mesh, global_batch, micro_batch)
    params = {n.name for n in graph.inputs() if n.attrs.get("requires_grad")}
    shape = tuple(mesh.shape)
    times = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    comm: dict[str, dict[str, float]] = {}
    forward_comm = 0.0
    # full recomputation redoes the numbered layers' forward (Megatron-LM checkpoints its transformer layers; the
    # embedding, the head and the loss run once): their kernels' seconds and FLOPs and their collectives' seconds
    layered = layer_nodes(graph) if recompute == "full" else set()
    layers_forward = {"seconds": 0.0, "comm": 0.0, "flops": 0.0}
    grad_sync, last_sync = 0.0, 0.0
    # a parameter's cotangent moved back to the parameter's own layout in each micro-batch's backward (a parameter
    # stored sharded and gathered where it is read, without zero=: FSDP's reduce-scatter), overlapped with it
    returned_s = 0.0
    flops = {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    gathers, first_gather = 0.0, None  # ZeRO-3's parameter all-gathers, per micro-batch
    regathers = 0.0  # of them, those for the backward (zero/regather/)
    per_op: list[tuple[float, str, str, str]] = []
    rules: dict = {}  # op -> its rule when the rule has comm_steps, else None
    unknown: set[str] = set()
    dtypes: dict[str, float] = {}
    for node in graph.topo_order():
        if node.op == "input":
            continue
        specs = node.meta.get(meta.SPECS)
        if not specs or None in specs:
            continue
        phase = _phase(graph, node)
        if node.op == "redistribute":
            src = value_spec(graph, node.inputs[0])
            if src is None:
                continue
            seconds = 0.0
            sync = node.meta.get(meta.GRAD_OF) in params or node.name.startswith("grad/zero/gather/")
            gather = node.name.startswith(("zero/gather/", "zero/regather/"))
            returned = not sync and not gather and phase == "backward" and _makes_gradient(graph, node, params)
            for step in plan_redistribution(src, specs[0].layout).steps:
                t = collective_time(step.kind, step.bytes_per_rank, shape, step.mesh_axis, cluster)
                seconds += t
                if t and not sync and not gather and not returned:
                    axis = comm.setdefault(mesh.names[step.mesh_axis], {})
                    axis[step.kind] = axis.get(step.kind, 0.0) + t
            if gather:
                gathers += seconds
                regathers += seconds if node.name.startswith("zero/regather/") else 0.0
                first_gather = seconds if first_gather is None else first_gather
            elif sync:
                grad_sync += seconds
                last_sync = seconds
            elif returned:
                returned_s += seconds
            elif phase == "forward":
                forward_comm += seconds
                layers_forward["comm"] += seconds if node.name in layered else 0.0
            if seconds:
                per_op.append((seconds * (1 if sync and stage < 2 else acc), node.name, "redistribute", phase))
            continue
        inputs = [value_spec(graph, v) for v in node.inputs]
        if any(s is None for s in inputs):
            continue
        attrs = node.meta.get(meta.ATTRS, node.attrs)
        steps = _comm_steps(node, attrs, inputs, specs, rules)
        if steps:  # an op that is communication (a ring attention's shift: a permute), priced as its collectives
            seconds = 0.0
            for step in steps:
                t = collective_time(step.kind, step.bytes_per_rank, shape, step.mesh_axis, cluster)
                seconds += t
                if t:
                    axis = comm.setdefault(mesh.names[step.mesh_axis], {})
                    axis[step.kind] = axis.get(step.kind, 0.0) + t
            if phase == "forward":
                forward_comm += seconds
                layers_forward["comm"] += seconds if node.name in layered else 0.0
            if seconds:
                per_op.append((seconds * acc, node.name, node.op, phase))
            continue
        dtype = inputs[0].dtype if inputs else specs[0].dtype
        cost = op_cost(node.op, [s.local_shape(0) for s in inputs], [s.local_shape(0) for s in specs],
                       [s.itemsize for s in inputs], [s.itemsize for s in specs], attrs, dtype=dtype)
        if cost_class(node.op) is None:
            unknown.add(node.op)
        seconds = op_time(cost, cluster)
        times[phase] += seconds
        flops[phase] += cost.flops
        if phase == "forward" and node.name in layered:
            layers_forward["seconds"] += seconds
            layers_forward["flops"] += cost.flops
        if cost.kind in ("matmul", "attention"):
            dtypes[dtype] = dtypes.get(dtype, 0.0) + cost.flops
        if seconds:
            per_op.append((seconds * acc, node.name, node.op, phase))
    for axis in comm.values():  # forward and backward collectives happen once per micro-batch
        for kind in axis:
            axis[kind] *= acc
    recompute_s = acc * times["recompute"]
    recompute_flops = flops["recompute"]
    if recompute == "full" and layered:
        recompute_s = acc * (layers_forward["seconds"] + layers_forward["comm"])
        recompute_flops = layers_forward["flops"]
    elif recompute == "full":  # no numbered layers: the whole forward again
        recompute_s = acc * (times["forward"] + forward_comm)
        recompute_flops = flops["forward"]
    local = {p: value_spec(graph, p) for p in params}
    updated = {p: spec.local_nbytes(0) for p, spec in local.items()}  # what the optimizer updates on this rank
    after_update = 0.0  # stages 1 and 2: the updated shards all-gathered, after the optimizer
    if stage in (1, 2):
        from layout_prop.core.spec import TensorSpec
        from layout_prop.passes.zero import shard_layouts

        updated = {}
        for name, layout in shard_layouts(graph, zero).items():
            spec = value_spec(graph, name)
            shard = TensorSpec(spec.shape, spec.dtype, layout)
            updated[name] = shard.local_nbytes(0)
            for step in plan_redistribution(shard, spec.layout).steps:
                after_update += collective_time(step.kind, step.bytes_per_rank, shape, step.mesh_axis, cluster)
    if stage >= 2:  # reduce-scattered (and, stage 3, gathered) every micro-batch, overlapped with its compute
        per_mb = grad_sync + gathers + returned_s
        if not overlap:
            exposed_sync = acc * per_mb
        elif stage == 2:
            exposed_sync = acc * max(per_mb - times["backward"], last_sync)
        else:  # a phase's gathers prefetched a layer ahead: hidden by that phase's compute only
            exposed_sync = acc * zero3_exposed(gathers - regathers, regathers + grad_sync, times["forward"],
                                               times["backward"] + times["recompute"], first_gather or 0.0,
                                               last_sync)
        grad_sync = acc * per_mb
    else:
        if not overlap:
            exposed_sync = grad_sync + acc * returned_s
        else:  # the returned cotangents under each micro-batch's backward, the last one's with the synchronisation
            exposed_sync = ((acc - 1) * max(returned_s - times["backward"], 0.0)
                            + max(grad_sync + returned_s - times["backward"], last_sync))
        exposed_sync += acc * gathers  # (gathers without zero=: exposed)
        grad_sync += acc * (gathers + returned_s)
    grad_sync += after_update
    exposed_sync += after_update
    optimizer_s = sum(optimizer_time(nbytes, local[p].itemsize, cluster) for p, nbytes in updated.items())
    # the micro-batches' weight gradients summed (stages 2 and 3: the reduce-scattered shard), in the backward
    accumulated = sum(updated.values()) if stage >= 2 else sum(spec.local_nbytes(0) for spec in local.values())
    accumulate_s = accumulation_time(accumulated, acc, cluster)
    model_dtype = max(dtypes, key=dtypes.get) if dtypes else "float32"
    memory = Memory(optimizer="adam", zero=zero).run(graph).max.total
    notes = []
    if unknown:
        notes.append(f"ops without a cost entry, costed as one FLOP an element: {', '.join(sorted(unknown))}")
    if memory > cluster.hbm_bytes:
        notes.append(f"memory per rank {memory:,} bytes exceeds the device's {cluster.hbm_bytes:,}")
    if recompute == "full":
        notes.append(("recompute full: the numbered layers' forward counted again (not the embedding, head and "
                      "loss)" if layered else "recompute full: one more forward counted")
                     + "; the memory figure does not subtract the activations recomputation saves")
    per_op.sort(reverse=True)
    top = [{"name": name, "op": op, "phase": phase, "seconds": seconds} for seconds, name, op, phase in per_op[:10]]
    step_flops = acc * (flops["forward"] + flops["backward"] + recompute_flops) * devices
    return StepEstimate(
        cluster=cluster.name, devices=devices, accumulation=acc, forward_s=acc * times["forward"],
        backward_s=acc * times["backward"] + accumulate_s, recompute_s=recompute_s, communication=comm, grad_sync_s=grad_sync,
        grad_sync_exposed_s=exposed_sync, optimizer_s=optimizer_s, flops_per_step=step_flops,
        peak_flops=cluster.peak_flops(model_dtype), memory_per_rank_bytes=memory, hbm_bytes=cluster.hbm_bytes,
        top_ops=top, notes=notes, zero_stage=stage, zero_gather_s=acc * gathers, forward_comm_s=acc * forward_comm)
