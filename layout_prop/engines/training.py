"""One training step on simulated ranks: forward, backward and the optimizer's update, per shard.

The execution proof of ZeRO (``passes/zero.py``): the lowered program of a graph analysed with
its backward (and, for ZeRO, finished by :func:`layout_prop.passes.zero.finish`) runs on the
:class:`~layout_prop.engines.simulator.Simulator`; then every rank updates the piece of each
parameter its optimizer state covers (``shard_layouts``: the parameter's own layout without
ZeRO, its ZeRO-sharded layout with it) with the gradient's piece, as a data-parallel
optimizer does:

- stage 0: every rank updates its whole (tensor-parallel) piece with the all-reduced gradient;
- stages 1 and 2: the graph's gradient is already reduce-scattered to the shard; the rank
  updates its shard of the parameter (cut locally from its whole piece) and the updated
  shards are all-gathered back to the parameter's layout (the simulator's exact collective);
- stage 3: the parameter is stored as the shard; the rank updates it in place (the next
  forward gathers it).

The result, assembled (replicas must agree), is compared with one device: the same graph
executed on global arrays with the numpy kernels, and the same optimizer on the whole
parameter.  Optimizers: :class:`SGD` and :class:`AdamW` (Loshchilov and Hutter, 2019:
decoupled weight decay), numpy.  Mixed precision as the ZeRO paper counts it (section 3.1): a
float16 or bfloat16 parameter's optimizer state holds a float32 master copy of its piece; the
update is computed on the master copy in float32 and the parameter is the master rounded to
its dtype (the moments are float32 too).

This module knows no pass: the caller analyses, lowers and chooses the shard layouts (see
``graph_tests/test_zero.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import ExecutionError
from layout_prop.core.graph import Graph
from layout_prop.core.layout import Layout
from layout_prop.core.redistribute import plan_redistribution
from layout_prop.core.spec import TensorSpec

from .collectives import apply_plan, assemble, scatter_global
from .simulator import Simulator, call_kernel

__all__ = ["SGD", "AdamW", "TrainingReport", "training_step", "execute_global_graph", "compare_outputs"]


@dataclass
class SGD:
    """Plain SGD with (coupled) weight decay: ``p - lr * (g + weight_decay * p)``; no state."""

    lr: float = 0.1
    weight_decay: float = 0.0
    name = "sgd"

    def init(self, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {}

    def update(self, p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        master = _master(p, state)
        new = master - self.lr * (g.astype(master.dtype) + self.weight_decay * master)
        return _keep(new, p, state)


@dataclass
class AdamW:
    """AdamW: two float32 moments per element, bias-corrected, decoupled weight decay."""

    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    name = "adamw"

    def init(self, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {"m": np.zeros(shape, np.float32), "v": np.zeros(shape, np.float32)}

    def update(self, p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray], step: int) -> np.ndarray:
        b1, b2 = self.betas
        g32 = g.astype(np.float32)
        state["m"] = b1 * state["m"] + (1 - b1) * g32
        state["v"] = b2 * state["v"] + (1 - b2) * g32 * g32
        m_hat = state["m"] / (1 - b1 ** step)
        v_hat = state["v"] / (1 - b2 ** step)
        master = _master(p, state)
        new = master - self.lr * (m_hat / (np.sqrt(v_hat) + self.eps) + self.weight_decay * master)
        return _keep(new, p, state)


def _master(p: np.ndarray, state: dict[str, np.ndarray]) -> np.ndarray:
    """The value the update starts from: the float32 master copy of a 16-bit parameter (made from
    the parameter at the first step), else the parameter itself."""
    if p.dtype.itemsize >= 4:
        return p
    if "master" not in state:
        state["master"] = p.astype(np.float32)
    return state["master"]


def _keep(new: np.ndarray, p: np.ndarray, state: dict[str, np.ndarray]) -> np.ndarray:
    """The updated parameter in its dtype; a 16-bit one's master copy keeps the float32 value."""
    if "master" in state:
        state["master"] = new.astype(np.float32)
    return new.astype(p.dtype)


@dataclass
class TrainingReport:
    """The updated parameters' errors against one device, and the collectives of the update."""

    ok: bool
    stage: int
    optimizer: str
    params: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> max_abs_err, max_rel_err
    mismatches: list[str] = field(default_factory=list)
    update_collectives: list[dict[str, Any]] = field(default_factory=list)  # the all-gathers after the update
    state_elements: dict[int, int] = field(default_factory=dict)  # rank -> optimizer-state elements it holds

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "stage": self.stage, "optimizer": self.optimizer, "params": self.params,
                "mismatches": self.mismatches, "update_collectives": self.update_collectives}


def execute_global_graph(graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value of ``graph`` on one device (the numpy kernels on global arrays)."""
    from layout_prop.kernels.numpy_backend import KERNELS, get_kernel

    env: dict[str, np.ndarray] = {}
    for node in graph.topo_order():
        if node.is_input:
            env[node.name] = inputs[node.name]
            continue
        dtypes = tuple(None if s is None else s.dtype for s in node.meta[meta.SPECS])
        res = call_kernel(get_kernel(node.op, KERNELS), [env[v] for v in node.inputs], node.meta[meta.ATTRS], dtypes)
        if node.num_outputs == 1:
            env[node.name] = np.asarray(res)
        else:
            env.update((v, np.asarray(r)) for v, r in zip(node.outputs, res))
    return env


def compare_outputs(graph: Graph, program, inputs: dict[str, np.ndarray], rtol: float = 1e-5) -> dict[str, float]:
    """Every output of ``graph`` (its gradients too, when analysed with backward) executed on the
    simulator from ``program`` and assembled, against one device: output -> relative error
    (the largest difference over the reference's largest magnitude); raises ``ExecutionError``
    ``mismatch`` past ``rtol``."""
    local = Simulator().execute(program, inputs, wanted=list(graph.outputs))
    reference = execute_global_graph(graph, inputs)
    errors = {}
    for value in graph.outputs:
        node, index = graph.producer(value)
        errors[value] = _errors(assemble(local[value], node.meta[meta.SPECS][index]), reference[value])["max_rel_err"]
    worst = max(errors, key=errors.get, default=None)
    if worst is not None and errors[worst] > rtol:
        raise ExecutionError("mismatch", f"{worst}: relative error {errors[worst]:.3g} > {rtol:g} against one device",
                             hint="a pass changed a value: compare the graph before and after it")
    return errors


def _errors(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / scale if scale > 0 else max_abs}


def training_step(graph: Graph, program, inputs: dict[str, np.ndarray], shard_layouts: dict[str, Layout],
                  stage: int, optimizer, *, rtol: float = 1e-5, steps: int = 1) -> TrainingReport:
    """Run ``steps`` training steps of ``graph`` (analysed with backward; lowered to ``program``)
    on the simulator and compare the updated parameters with one device's.

    Parameters
    ----------
    graph : Graph
        Analysed with its backward, resharded (and ZeRO-finished); its ``grad/NAME`` values
        hold each parameter's gradient.
    program : layout_prop.passes.lower.Program
        ``graph`` lowered.
    inputs : dict
        The global arrays of every graph input (parameters, data, cotangents).
    shard_layouts : dict of str to Layout
        For each parameter, the layout its optimizer state lives in (and, for stage 3, the
        stored layout: the parameter's own).
    stage : int
        The ZeRO stage (0 to 3).
    optimizer : SGD or AdamW
    rtol : float
        Tolerance on the largest difference relative to the parameter's largest magnitude.
    steps : int
        Steps run (the same data each step; the updated parameters feed the next).
    """
    grads = {n.meta[meta.GRAD_OF]: n.name for n in graph.nodes if n.meta.get(meta.GRAD_OF)}
    specs = {n.name: n.meta[meta.SPECS][0] for n in graph.inputs()}
    missing = [p for p in shard_layouts if p not in grads]
    if missing:
        raise ExecutionError("missing-output", f"no gradient for parameter(s) {missing[:3]}",
                             hint="analyse the graph with backward=True; give shard layouts of parameters only")
    report = TrainingReport(ok=False, stage=stage, optimizer=optimizer.name)
    simulator = Simulator()
    ref_params = {p: np.asarray(inputs[p]).copy() for p in shard_layouts}
    ref_states = {p: optimizer.init(ref_params[p].shape) for p in shard_layouts}
    # every rank's piece of each parameter in the layout the graph reads it in, and its optimizer state
    pieces = {p: scatter_global(inputs[p], specs[p]) for p in shard_layouts}
    states: dict[str, list[dict]] = {}
    shard_specs = {p: TensorSpec(specs[p].shape, specs[p].dtype, layout) for p, layout in shard_layouts.items()}
    for p, spec in shard_specs.items():
        states[p] = [optimizer.init(spec.local_shape(r)) for r in range(graph.mesh.size)]
    report.state_elements = {r: sum(int(np.prod(shard_specs[p].local_shape(r))) for p in shard_layouts)
                             for r in range(graph.mesh.size)}
    data = dict(inputs)
    for step in range(1, steps + 1):
        local = simulator.execute(program, data, scattered=dict(pieces), wanted=[grads[p] for p in shard_layouts])
        reference = execute_global_graph(graph, {**data, **ref_params})
        for p, shard in shard_specs.items():
            grad_spec = graph.node(grads[p]).meta[meta.SPECS][0]
            g = apply_plan(plan_redistribution(grad_spec, shard.layout), local[grads[p]])
            mine = apply_plan(plan_redistribution(specs[p], shard.layout), pieces[p])
            updated = [optimizer.update(mine[r], g[r], states[p][r], step) for r in range(graph.mesh.size)]
            back = plan_redistribution(shard, specs[p].layout)
            if step == 1:
                report.update_collectives.extend({"param": p, **s.to_dict()} for s in back.steps
                                                 if s.kind != "local-slice")
            pieces[p] = apply_plan(back, updated)
            ref_params[p] = optimizer.update(ref_params[p], reference[grads[p]], ref_states[p], step)
    for p in shard_layouts:
        got = assemble(pieces[p], specs[p])  # replicas must agree
        report.params[p] = _errors(got, ref_params[p])
        if report.params[p]["max_rel_err"] > rtol:
            report.mismatches.append(f"{p}: relative error {report.params[p]['max_rel_err']:.3g} > {rtol:g}")
    report.ok = not report.mismatches
    return report

