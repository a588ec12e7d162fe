"""Executing a pipelined program (:class:`~layout_prop.passes.pipeline.PipelineProgram`) on simulated ranks.

Every stage holds, per micro-batch, the local arrays of its stage-mesh ranks (one list per
value, as the simulator's environment).  The stages' tasks run in an order that respects
every dependency: the schedule timed with :func:`~layout_prop.passes.schedule.simulate`
(forward 1, backward 2), each task at its start time.  Before a task, each value it
receives crosses the pipeline axis through a real ``permute`` step on the whole mesh
(the program's ``collective`` op, run by :meth:`Simulator.run_op`: the sender's stage holds the pieces,
every other stage zeros, and the receiver keeps what arrives).  A move once a step (``step_moves``,
a tied embedding's gradient term) crosses only before the task's last micro-batch, carrying the
sender's sum over the micro-batches; the receiver holds zeros in its place before.  Then the
task's local ops run on the stage mesh (:meth:`Simulator.run_op`).

Across micro-batches: the gradient outputs are summed on each rank (gradient
accumulation), scalar forward outputs are combined as ``config.loss`` says (the mean of the
micro-batch losses by default) and other forward outputs are concatenated along dim 0.
The loss cotangent each micro-batch's backward starts from is the caller's (give it scaled
by ``1/M`` for a mean: :mod:`layout_prop.passes.pipeline`).

The program is duck-typed here (this room does not import passes): ``mesh``, ``config``,
``program``, ``tasks``, ``inputs``, ``moves``, ``receives``, ``orders``, ``batch_inputs``, ``grads``,
``outputs``, ``stage_inputs``, ``lift``, ``permute``, ``rank_at``, ``micro_batch_op``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from layout_prop.core.errors import ExecutionError

from .collectives import assemble, scatter_global
from .simulator import Simulator

__all__ = ["execute_pipeline", "PipelineRun", "gather_rank_results"]


@dataclass
class PipelineRun:
    """What :func:`execute_pipeline` returns: the assembled ``values`` (global arrays by output
    name), the ``order`` the tasks ran in (stage, task name), the ``moves`` made every micro-batch
    and the ``step_moves`` made once a step, in the last micro-batch (each: value, micro-batch,
    from stage, to stage, bytes per rank)."""

    values: dict[str, np.ndarray] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)
    moves: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    step_moves: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


def execute_pipeline(pprog, micro_inputs: list[dict[str, np.ndarray]], shared_inputs: dict[str, np.ndarray],
                     simulator: Simulator | None = None,
                     progress: Callable[[int, int], None] | None = None) -> PipelineRun:
    """Run every stage's schedule of ``pprog`` (module docstring).

    Parameters
    ----------
    pprog : layout_prop.passes.pipeline.PipelineProgram
        The pipelined program.
    micro_inputs : list of dict
        One dict per micro-batch: the global arrays of the batch inputs (one micro-batch each).
    shared_inputs : dict
        The global arrays of every other input (parameters, the loss cotangent), the same for
        every micro-batch.
    simulator : Simulator, optional
        Runs the ops (default: a new one, numpy kernels).
    progress : callable, optional
        Called as ``progress(done, total)`` after each task (a stage's chunk of one micro-batch).

    Returns
    -------
    PipelineRun

    Raises
    ------
    ExecutionError
        ``missing-input`` for an input given nowhere; the kernels' and steps' errors.
    """
    sim = simulator or Simulator()
    config = pprog.config
    m, p = config.micro_batches, config.stages
    if len(micro_inputs) != m:
        raise ExecutionError("missing-input", f"{len(micro_inputs)} micro-batches of inputs for a pipeline of {m}",
                             hint="give one dict of batch inputs per micro-batch")
    size = pprog.program.mesh.size
    input_ops = {op.name: op for op in pprog.inputs}
    shared_pieces: dict[str, list[np.ndarray]] = {}
    envs: list[list[dict[str, list[np.ndarray]]]] = []
    for stage in range(p):
        per_mb = []
        for k in range(m):
            env = {}
            for name in pprog.stage_inputs.get(stage, ()):
                spec = input_ops[name].specs[0]
                if name in pprog.batch_inputs:
                    env[name] = scatter_global(np.asarray(_given(micro_inputs[k], name)), spec, None)
                else:
                    if name not in shared_pieces:
                        shared_pieces[name] = scatter_global(np.asarray(_given(shared_inputs, name)), spec, None)
                    env[name] = shared_pieces[name]
            per_mb.append(env)
        envs.append(per_mb)
    run = PipelineRun()
    held = [0] * p
    run.in_flight = [0] * p
    tasks = len(pprog.run_order)
    for done, (stage, task) in enumerate(pprog.run_order, 1):
        env = envs[stage][task.micro_batch]
        key = (task.chunk, task.phase)
        for move, once in pprog.receives(key):
            if move.dst_stage != stage:
                continue
            sent = envs[move.src_stage][task.micro_batch][move.value]
            if once and task.micro_batch < m - 1:  # sent once a step, in the last micro-batch: zeros until then
                env[move.value] = [np.zeros_like(piece) for piece in sent]
                continue
            if once:  # the sender's sum over the micro-batches (all made: a stage runs a task in micro-batch order)
                sent = [sum(envs[move.src_stage][k][move.value][q] for k in range(m)) for q in range(size)]
            op = pprog.move_op(move)
            whole = {move.value: [sent[pprog.stage_rank(rank)] if pprog.stage_of(rank) == move.src_stage
                                  else np.zeros_like(sent[pprog.stage_rank(rank)])
                                  for rank in range(pprog.mesh.size)]}
            sim.run_op(op, whole, pprog.mesh.size)  # the permute step, as every collective runs
            env[move.value] = [whole[move.value][pprog.rank_at(stage, q)] for q in range(size)]
            record = (move.value, task.micro_batch, move.src_stage, stage, op.step.bytes_per_rank)
            (run.step_moves if once else run.moves).append(record)
        for op in pprog.tasks.get(key, ()):
            sim.run_op(pprog.micro_batch_op(op, task.micro_batch), env, size)  # its random draws: its rows'
        held[stage] += 1 if task.phase == "F" else -1
        run.in_flight[stage] = max(run.in_flight[stage], held[stage])
        run.order.append((stage, str(task)))
        if progress is not None:
            progress(done, tasks)
    specs = pprog.program.specs
    for value in pprog.grads:  # gradient accumulation: each rank sums its local pieces over the micro-batches
        stage = _stage_holding(envs, value)
        pieces = [sum(envs[stage][k][value][q] for k in range(m)) for q in range(size)]
        run.values[value] = assemble(pieces, specs[value])
    for value in pprog.outputs:
        stage = _stage_holding(envs, value)
        per_mb = [assemble(envs[stage][k][value], specs[value]) for k in range(m)]
        if per_mb[0].ndim == 0:
            total = sum(per_mb)
            run.values[value] = np.asarray(total / m if config.loss == "mean" else total, dtype=per_mb[0].dtype)
        else:
            run.values[value] = np.concatenate(per_mb, axis=0)
    return run


def _given(arrays: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name not in arrays:
        raise ExecutionError("missing-input", f"no value given for graph input {name!r}", input=name,
                             hint="give every graph input an array")
    return arrays[name]


def _stage_holding(envs, value: str) -> int:
    for stage, per_mb in enumerate(envs):
        if value in per_mb[0]:
            return stage
    raise ExecutionError("missing-output", f"no stage made {value!r}", hint="please report this: a task did not run")


def gather_rank_results(rank_programs, results: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    """The global values of a pipelined run made one rank a process
    (:class:`~layout_prop.passes.pipeline.RankPrograms` on msrun): ``results`` is what the engine
    returns for ``rank_programs.wanted()``; each value is assembled from the ranks of the stage
    holding it, gradients as summed by the ranks, forward outputs combined over micro-batches as
    :func:`execute_pipeline` does."""
    pprog = rank_programs.pipeline
    m = pprog.config.micro_batches

    def assembled(value: str, local: str) -> np.ndarray:
        stage = rank_programs.holders[value]
        ranks = [pprog.rank_at(stage, q) for q in range(pprog.program.mesh.size)]
        return assemble([results[value][r] for r in ranks], pprog.program.specs[local])

    values = {grad: assembled(grad, grad) for grad in pprog.grads}
    for value in pprog.outputs:
        per_mb = [assembled(f"{value}@mb{k}", value) for k in range(m)]
        if per_mb[0].ndim == 0:
            total = sum(per_mb)
            values[value] = np.asarray(total / m if pprog.config.loss == "mean" else total, dtype=per_mb[0].dtype)
        else:
            values[value] = np.concatenate(per_mb, axis=0)
    return values
