"""Analytic composition of a training step over pipeline, data and ZeRO parallelism.

The configuration search (:mod:`layout_prop.planner.search`) prices one transformer layer
with the step model (:func:`layout_prop.perf.step.estimate_step` on a one-layer graph
sharded on the tensor, context and expert axes) and composes the whole step with the pure
functions here, each from a published equation:

- the pipeline bubble and step: Narayanan et al., "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473), section 2.2:
  bubble fraction ``(p - 1) / m`` for GPipe and 1F1B, ``(p - 1) / (v m)`` for the
  interleaved schedule with ``v`` model chunks a device;
- the activations a stage keeps in flight: GPipe all ``m`` micro-batches, 1F1B at most
  ``p`` (Narayanan et al., section 2.2.1), interleaved ``p (1 + (p - 1) / (p v))``
  micro-batches' worth (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022, arXiv:2205.05198, section 4.2.3);
- a transformer layer's activation bytes with tensor and sequence parallelism and
  recomputation: Korthikanti et al., equations 1 to 5 and section 5
  (:func:`activation_bytes_per_layer`);
- ZeRO's model-state bytes per device and its communication volume: Rajbhandari et al.,
  "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20
  (arXiv:1910.02054), section 5 and figure 1 (``(2 + 2 + K) psi`` with ``K = 12`` for mixed
  precision Adam; stages 1, 2, 3 divide the optimizer states, then the gradients, then the
  parameters by ``N_d``) and section 7 (stages 1 and 2 move ``2 psi`` a step as data
  parallelism does, stage 3 ``3 psi``);
- point-to-point activation transfers between stages and the data-parallel gradient
  synchronisation priced with the cluster's links (:mod:`layout_prop.perf.collectives`);
- the memory-bound passes over the parameters that no layer's graph holds, at their byte count
  through HBM: the gradient accumulation over micro-batches (:func:`accumulation_time`) and the
  optimizer step (:func:`optimizer_time`).

Examples
--------
>>> bubble_fraction(8, 32, "1f1b"), bubble_fraction(8, 32, "interleaved", 4)
(0.21875, 0.0546875)
>>> zero_model_state_bytes(1_000, 0, 8), zero_model_state_bytes(1_000, 3, 8)
(16000, 2000.0)
"""

from __future__ import annotations

import math

from .clusters import Cluster
from .collectives import collective_time

__all__ = ["SCHEDULES", "RECOMPUTE_MODES", "ZERO_STAGES", "bubble_fraction", "pipeline_time", "pipeline_makespan",
           "critical_moves", "inflight_microbatches",
           "activation_bytes_per_layer", "layer_activation_bytes", "zero_model_state_bytes", "zero_communication_bytes", "p2p_time",
           "grad_sync_time", "zero_sync_parts", "zero3_gather_time", "optimizer_state_bytes_per_param", "ceil_div",
           "accumulation_time", "optimizer_bytes_per_param", "optimizer_time", "zero3_exposed"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE_MODES = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


def bubble_fraction(p: int, m: int, schedule: str, v: int = 1) -> float:
    """The pipeline bubble over the ideal time (Narayanan et al. SC'21, section 2.2).

    ``(p - 1) / m`` for GPipe and 1F1B, ``(p - 1) / (v m)`` interleaved with ``v`` chunks a device.

    >>> bubble_fraction(1, 4, "gpipe"), bubble_fraction(4, 12, "gpipe"), bubble_fraction(4, 12, "interleaved", 2)
    (0.0, 0.25, 0.125)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    chunks = v if schedule == "interleaved" else 1
    return (p - 1) / (chunks * m)


def pipeline_time(stage_s: float, p: int, m: int, schedule: str, v: int = 1) -> float:
    """A step's forward and backward time through the pipeline: ``m t (1 + bubble)``.

    ``stage_s`` is one micro-batch's forward and backward on the busiest stage (all its
    layers); the ideal is ``m`` of them, and the bubble adds ``(p - 1)`` stage times
    (``(p - 1) / v`` interleaved), the paper's ``(p - 1) (t_f + t_b)``.

    >>> pipeline_time(1.0, 4, 8, "1f1b"), pipeline_time(1.0, 4, 8, "interleaved", 3)
    (11.0, 9.0)
    """
    return m * stage_s * (1 + bubble_fraction(p, m, schedule, v))


def critical_moves(p: int, m: int, schedule: str, v: int = 1) -> int:
    """Stage-to-stage moves each way on the critical path of ``m`` micro-batches through ``p`` uniform stages
    (with ``t_move`` no longer than a chunk, interleaved): the move count of :func:`pipeline_makespan`.

    GPipe ``p - 1``; 1F1B ``m + p - 2 - ceil((m - 1) / p)``; interleaved with ``v`` chunks a stage ``p v - 1``.

    >>> critical_moves(4, 16, "gpipe"), critical_moves(4, 16, "1f1b"), critical_moves(4, 4, "1f1b")
    (3, 14, 5)
    >>> critical_moves(2, 8, "interleaved", 2), critical_moves(1, 8, "1f1b")
    (3, 0)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    if p <= 1:
        return 0
    if schedule == "gpipe":
        return p - 1
    if schedule == "1f1b":
        return m + p - 2 - math.ceil((m - 1) / p)
    return p * v - 1


def pipeline_makespan(t_forward: float, t_backward: float, p: int, m: int, schedule: str, v: int = 1,
                      move_forward: float = 0.0, move_backward: float | None = None, move_last: float = 0.0) -> float:
    """A step's forward and backward through ``p`` uniform stages with a move on every stage-to-stage dependency,
    as :func:`layout_prop.passes.schedule.simulate` times the schedule's task orders.

    ``t_forward`` and ``t_backward`` are one micro-batch's forward and backward on a stage (all its ``v``
    chunks); ``move_forward`` the wait of a forward chunk for its input from the previous stage,
    ``move_backward`` (default the same) of a backward chunk for its gradient from the next.  ``move_last`` is
    what the step's last task (micro-batch ``m - 1``'s first chunk, backward, on stage 0) waits for beyond its
    backward move: a message sent once a step on the same link, as the pipelined program sends a tied
    embedding's gradient (the last stage's sum over the micro-batches) before it.  That task waits on its input,
    so the makespan grows by it: exact against the simulation for every schedule, wherever the rest is.

    The makespan is the longest path of the dependency graph (each stage's order, and each chunk's input from
    the previous chunk, a move later).  Every path from the first forward to the last backward (both on stage
    0) climbs the stages with forward moves and comes down with as many backward moves, and no path holds more
    than ``(m + p - 1)`` stage-forward-and-backward times of compute (Narayanan et al.'s ``(p - 1)`` bubble
    slots), so the makespan is ``(m + (p - 1) / v) (t_f + t_b) + K (d_f + d_b)`` with ``K`` the most moves
    each way a path of that compute holds (:func:`critical_moves`):

    - GPipe: a stage runs every forward before any backward, so a path turns from forward to backward once,
      ``K = p - 1``;
    - 1F1B: stage ``s`` follows its backward of micro-batch ``k`` with the forward of ``k + p - s``, so a
      path may come down to stage ``s`` and climb again; a round trip between stages ``s`` and ``s + h``
      advances ``h + 1`` micro-batches for ``2 h`` moves.  Counting the micro-batch index along a path
      (``m - 1`` in all, each climb-and-descent ending at the top stage), a path with ``n`` descents has
      ``m - 1 + p - n`` moves each way, at least ``n = 1 + ceil((m - 1) / p)`` descents:
      ``K = m + p - 2 - ceil((m - 1) / p)``, attained by a path of full compute (one that waits at the last
      stage, which alternates a forward and a backward, for the micro-batches it does not take round);
    - interleaved 1F1B (``m`` a multiple of ``p``): ``K = p v - 1`` (one micro-batch through every chunk and
      back), exact for ``m = p`` and while a move is no longer than the shorter of a chunk's forward and
      backward.  Beyond that the moves of later micro-batches come onto the path too; this adds the
      steady state's extra wait, ``(p v - 1) / p`` moves' excess over that chunk time a micro-batch, for
      ``m - p`` micro-batches: an approximation, measured within -10.4% and +8.5% of the simulation on
      ``p`` 2-8, ``v`` 2-4, ``m`` p-16p, forward:backward 1:3 to 2:1, moves 1.25 to 8 chunk times
      (graph_tests/test_pipeline_makespan.py).

    Exact (against the simulation) for GPipe and 1F1B at every move time, and for interleaved in the ranges
    said; without moves it is :func:`pipeline_time` of ``t_f + t_b``.

    >>> pipeline_makespan(1.0, 2.0, 4, 8, "1f1b"), pipeline_makespan(1.0, 2.0, 4, 8, "1f1b", move_forward=0.5)
    (33.0, 41.0)
    >>> pipeline_makespan(1.0, 2.0, 4, 8, "gpipe", move_forward=0.5), pipeline_makespan(1.0, 2.0, 4, 8, "1f1b",
    ...                   move_forward=0.5, move_backward=1.0)
    (36.0, 45.0)
    >>> pipeline_makespan(1.0, 2.0, 2, 8, "1f1b", move_forward=0.5, move_last=0.25)  # 27 + 4 x (0.5 + 0.5) + 0.25
    31.25
    """
    if move_backward is None:
        move_backward = move_forward
    if p <= 1:
        return m * (t_forward + t_backward)
    chunks = v if schedule == "interleaved" else 1
    compute = (m + (p - 1) / chunks) * (t_forward + t_backward)
    moves = critical_moves(p, m, schedule, v) * (move_forward + move_backward)
    if schedule == "interleaved":
        excess = (move_forward + move_backward) / 2 - min(t_forward, t_backward) / v
        if excess > 0:
            moves += (m - p) * (p * v - 1) / p * excess
    return compute + moves + move_last


def inflight_microbatches(p: int, m: int, schedule: str, v: int = 1) -> float:
    """Micro-batches' activations the first stage holds at its peak (its ``L / p`` layers each).

    GPipe keeps all ``m`` (every forward before any backward); 1F1B at most ``p``
    (Narayanan et al. SC'21, section 2.2.1); interleaved 1F1B ``p (1 + (p - 1) / (p v))``
    (Korthikanti et al. 2022, section 4.2.3), at most ``m`` (a pipeline with fewer
    micro-batches than stages holds them all).

    >>> inflight_microbatches(8, 32, "gpipe"), inflight_microbatches(8, 32, "1f1b")
    (32, 8)
    >>> inflight_microbatches(8, 32, "interleaved", 2), inflight_microbatches(8, 4, "1f1b")
    (11.5, 4)
    """
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p, m)
    return min(p * (1 + (p - 1) / (p * v)), m)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = True,
                               recompute: str = "none") -> float:
    """Bytes of activations a transformer layer stores, 16-bit, with dropout (Korthikanti et al. 2022).

    ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel degree:

    - no recomputation, no parallelism: ``s b h (34 + 5 a s / h)`` (their equation 1);
    - tensor parallel: ``s b h (10 + 24 / t + 5 a s / (h t))`` (equation 2);
    - tensor and sequence parallel: ``s b h / t (34 + 5 a s / h)`` (equation 4);
    - selective recomputation (the attention core) drops the ``5 a s / h`` term
      (equations 5 and 6: ``34 s b h / t`` with sequence parallelism);
    - full recomputation keeps the layer's input: ``2 s b h`` bytes, over ``t`` with
      sequence parallelism (section 5).

    >>> activation_bytes_per_layer(2048, 1, 12288, 96)  # GPT-3 175B, one sequence: 34 sbh + 5 a s^2 b
    2868903936.0
    >>> activation_bytes_per_layer(2048, 1, 12288, 96, t=8, recompute="selective")
    106954752.0
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return s * b * h / t * (34 + attention)
    return s * b * h * (10 + 24 / t + attention / t)


def layer_activation_bytes(s: int, b: int, h: int, a: int, ffn: int, t: int = 1, kv_heads: int | None = None,
                           gated: bool = False, dropout: bool = True, sequence_parallel: bool = True,
                           itemsize: int = 2) -> float:
    """Bytes a transformer layer stores for its backward besides the attention core (the ``(s x s)`` scores,
    probabilities and their dropout), Korthikanti et al. 2022's section 4.1 accounting generalised to grouped
    key/value heads and a gated MLP:

    - the two norms' inputs ``2 + 2``; the QKV projection's input ``2``; Q ``2``, K and V ``2 + 2`` (times
      ``kv / a`` with grouped heads); the attention output (the projection's input) ``2``; the projection's
      dropout mask ``1``;
    - the MLP's input ``2``; GPT: the first linear's output (GeLU's input) and GeLU's output, ``2 f / h`` each;
      gated (SwiGLU): the gate's and the up projection's outputs and their product, ``2 f / h`` each; the
      MLP's dropout mask ``1``;

    in ``s b h`` units of 16-bit items (``itemsize / 2`` otherwise; the masks are a byte an element): 34 for
    GPT (``f = 4 h``, dropout), their equation 1 without the ``5 a s / h`` core.  With sequence parallelism all
    of it is split by ``t`` (their equation 4); without, the norms' and projections' inputs and the masks (10 of
    GPT's 34) are whole on every tensor-parallel rank (equation 2).

    >>> s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B: 34 s b h / t with sequence parallelism (equation 6)
    >>> layer_activation_bytes(s, b, h, a, 4 * h, t=8) == 34 * s * b * h / 8
    True
    >>> layer_activation_bytes(s, b, h, a, 4 * h, t=8, sequence_parallel=False) == s * b * h * (10 + 24 / 8)
    True
    """
    e = itemsize / 2
    kv = (kv_heads or a) / a
    mask = 1.0 if dropout else 0.0
    whole = e * (2 + 2 + 2 + 2) + 2 * mask  # norms' inputs, QKV and MLP inputs, masks: not split without SP
    split = e * (2 + 4 * kv + 2) + e * (3 if gated else 2) * 2 * ffn / h  # Q, K, V, attention output, MLP
    if sequence_parallel:
        return s * b * h * (whole + split) / t
    return s * b * h * (whole + split / t)


def optimizer_state_bytes_per_param(itemsize: int) -> int:
    """``K`` of ZeRO: Adam's momentum and variance in float32, and a float32 master copy of a lower-precision
    parameter (``K = 12`` for 16-bit training, Rajbhandari et al. section 3.1; 8 for float32 training).

    >>> optimizer_state_bytes_per_param(2), optimizer_state_bytes_per_param(4)
    (12, 8)
    """
    return 8 + (4 if itemsize < 4 else 0)


def optimizer_bytes_per_param(itemsize: int) -> int:
    """Bytes Adam moves through HBM a parameter and step (Kingma and Ba, "Adam", ICLR 2015, algorithm 1: the update
    reads the gradient, the parameter and the two moments and writes the parameter and the moments), with the
    states as mixed-precision training keeps them (Micikevicius et al., "Mixed Precision Training", ICLR 2018: a
    float32 master copy of a 16-bit parameter, updated in float32, then copied to the 16-bit weights): the
    gradient read (``itemsize``), the parameter (or its float32 master) and the moments read and written (6 items
    of the parameter's dtype, at least float32), and for a 16-bit model the 16-bit copy written (``itemsize``).

    >>> optimizer_bytes_per_param(4), optimizer_bytes_per_param(2), optimizer_bytes_per_param(8)
    (28, 28, 56)
    """
    return itemsize + 6 * max(itemsize, 4) + (itemsize if itemsize < 4 else 0)


def optimizer_time(param_bytes: float, itemsize: int, cluster: Cluster) -> float:
    """Seconds of the optimizer step over ``param_bytes`` of parameters of ``itemsize`` bytes on one device: the
    bytes :func:`optimizer_bytes_per_param` says, through HBM at the profile's ``memory_efficiency``.

    >>> from layout_prop.perf.clusters import get_cluster
    >>> round(optimizer_time(2e9, 2, get_cluster("a100-80g")) * 1e3, 2)  # 1e9 16-bit parameters: 28 GB, ms
    17.17
    """
    return param_bytes / itemsize * optimizer_bytes_per_param(itemsize) / (cluster.hbm_bytes_per_s
                                                                           * cluster.memory_efficiency)


def accumulation_time(grad_bytes: float, micro_batches: int, cluster: Cluster) -> float:
    """Seconds a device spends summing ``micro_batches`` micro-batches' weight gradients (``grad_bytes`` each):
    every micro-batch after the first adds its gradient into the accumulated one, reading both and writing one
    (PyTorch's autograd accumulates a leaf's gradient into its ``.grad``, torch.Tensor.backward; MindSpore's
    gradient accumulation and Megatron-LM's ``main_grad`` buffers likewise), a memory-bound pass at the
    profile's ``memory_efficiency`` of HBM. With ZeRO stages 2 and 3 the gradient is reduce-scattered every
    micro-batch and the shard is accumulated (the caller passes the shard's bytes).

    >>> from layout_prop.perf.clusters import get_cluster
    >>> a100 = get_cluster("a100-80g")
    >>> accumulation_time(1e9, 1, a100), round(accumulation_time(1e9, 5, a100) * 1e3, 2)  # 4 adds of 3 GB: ms
    (0.0, 7.36)
    """
    if micro_batches <= 1 or grad_bytes <= 0:
        return 0.0
    return (micro_batches - 1) * 3 * grad_bytes / (cluster.hbm_bytes_per_s * cluster.memory_efficiency)


def zero_model_state_bytes(params: int, stage: int, dp: int, itemsize: int = 2) -> float:
    """Bytes of parameters, gradients and optimizer states a device holds (Rajbhandari et al., figure 1).

    With ``psi`` parameters of ``itemsize`` bytes (gradients the same) and ``K`` bytes of optimizer
    state a parameter: stage 0 ``(2 + 2 + K) psi``, stage 1 ``(2 + 2) psi + K psi / N_d``,
    stage 2 ``2 psi + (2 + K) psi / N_d``, stage 3 ``(2 + 2 + K) psi / N_d`` (for 16-bit items).

    >>> psi = 7.5e9  # the paper's example: 7.5B parameters, N_d = 64
    >>> [round(zero_model_state_bytes(psi, z, 64) / 1e9, 1) for z in range(4)]
    [120.0, 31.4, 16.6, 1.9]
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"unknown ZeRO stage {stage!r}")
    k = optimizer_state_bytes_per_param(itemsize)
    weights, grads = itemsize * params, itemsize * params
    optimizer = k * params
    if stage >= 1:
        optimizer /= dp
    if stage >= 2:
        grads /= dp
    if stage >= 3:
        weights /= dp
    return weights + grads + optimizer


def zero_communication_bytes(param_bytes: float, stage: int) -> float:
    """Bytes a device moves a step for the data-parallel gradients and parameters (Rajbhandari et al., section 7).

    Data parallelism and ZeRO stages 1 and 2 move ``2 psi`` (an all-reduce, or a
    reduce-scatter and an all-gather); stage 3 ``3 psi`` (the parameters gathered for the
    forward and again for the backward, the gradients reduce-scattered).

    >>> zero_communication_bytes(100, 0), zero_communication_bytes(100, 2), zero_communication_bytes(100, 3)
    (200, 200, 300)
    """
    return (3 if stage == 3 else 2) * param_bytes


def p2p_time(nbytes: float, cluster: Cluster, across_nodes: bool) -> float:
    """Seconds to send ``nbytes`` to the next pipeline stage: one link, its latency once.

    >>> from layout_prop.perf.clusters import get_cluster
    >>> round(p2p_time(25e6, get_cluster("a100-80g"), True) * 1e3, 3)  # 25 MB over 25 GB/s at 80%: ms
    1.256
    """
    if nbytes <= 0:
        return 0.0
    link = cluster.inter if across_nodes else cluster.intra
    return nbytes / (link.GBps * 1e9 * cluster.link_efficiency) + link.latency_us * 1e-6


def grad_sync_time(grad_bytes: float, stage: int, mesh_shape: tuple[int, ...], axis: int, cluster: Cluster) -> float:
    """Seconds of the data-parallel synchronisation of ``grad_bytes`` a device on mesh axis ``axis``.

    Stage 0 all-reduces the gradients; stages 1 and 2 reduce-scatter them and all-gather
    the updated parameters (the same bytes); stage 3 adds a second all-gather (the
    parameters for the backward): :func:`zero_communication_bytes` in the collective
    model's per-rank terms (an all-reduce sends ``2 (n - 1) / n`` of the buffer).
    """
    n = mesh_shape[axis]
    if n <= 1 or grad_bytes <= 0:
        return 0.0
    share = (n - 1) / n * grad_bytes
    if stage == 0:
        return collective_time("all-reduce", 2 * share, mesh_shape, axis, cluster)
    gathers = 2 if stage == 3 else 1
    return (collective_time("reduce-scatter", share, mesh_shape, axis, cluster)
            + gathers * collective_time("all-gather", share, mesh_shape, axis, cluster))


def zero_sync_parts(grad_bytes: float, stage: int, mesh_shape: tuple[int, ...], axis: int,
                    cluster: Cluster) -> tuple[float, float]:
    """``(reduce_s, gather_s)``: the gradient reduction and the parameter all-gathers of :func:`grad_sync_time`
    apart, as the step model places them (:mod:`layout_prop.perf.step`): stage 0 all-reduces (no gather);
    stages 1 and 2 reduce-scatter, then all-gather the updated parameters once after the optimizer; stage 3
    gathers the parameters for the forward and the backward (``gather_s`` is both, every parameter twice: the
    paper's ``3 psi``; the search prices stage 3's gathers with :func:`zero3_gather_time`, as the program does
    them) and reduce-scatters.

    >>> from layout_prop.perf.clusters import get_cluster
    >>> a100 = get_cluster("a100-80g")
    >>> r, g = zero_sync_parts(64e6, 1, (16, 8), 0, a100)
    >>> round((r + g) / grad_sync_time(64e6, 1, (16, 8), 0, a100), 6), zero_sync_parts(64e6, 0, (1, 8), 0, a100)
    (1.0, (0.0, 0.0))
    """
    n = mesh_shape[axis]
    if n <= 1 or grad_bytes <= 0:
        return 0.0, 0.0
    share = (n - 1) / n * grad_bytes
    if stage == 0:
        return collective_time("all-reduce", 2 * share, mesh_shape, axis, cluster), 0.0
    gathers = 2 if stage == 3 else 1
    return (collective_time("reduce-scatter", share, mesh_shape, axis, cluster),
            gathers * collective_time("all-gather", share, mesh_shape, axis, cluster))


def zero3_gather_time(gathered: tuple[float, int], regathered: tuple[float, int], mesh_shape: tuple[int, ...],
                      axis: int, cluster: Cluster) -> tuple[float, float]:
    """``(first_s, gather_s)``: ZeRO-3's parameter all-gathers of one micro-batch on mesh axis ``axis``, as the
    program does them (passes/zero.py): every parameter for the forward (``gathered``: bytes and tensors a rank),
    and again for the backward only the parameters the backward reads (``regathered``, :func:`regather`: a
    linear layer's bias is not read by its gradient), one collective a tensor of the mean size.
    ``first_s`` is one forward gather (the step waits for it), ``gather_s`` all of them.

    >>> from layout_prop.perf.clusters import get_cluster
    >>> a100 = get_cluster("a100-80g")
    >>> first, both = zero3_gather_time((64e6, 4), (64e6, 4), (16, 8), 0, a100)
    >>> round(both / zero_sync_parts(16e6, 3, (16, 8), 0, a100)[1], 6), round(both / first, 6)
    (4.0, 8.0)
    >>> zero3_gather_time((64e6, 4), (0.0, 0), (16, 8), 0, a100)[1] == 4 * first
    True
    """
    n = mesh_shape[axis]
    if n <= 1:
        return 0.0, 0.0
    seconds = []
    for nbytes, tensors in (gathered, regathered):
        one = collective_time("all-gather", (n - 1) / n * nbytes / tensors, mesh_shape, axis, cluster) \
            if tensors > 0 and nbytes > 0 else 0.0
        seconds.append((one, tensors * one))
    return seconds[0][0], seconds[0][1] + seconds[1][1]


def zero3_exposed(forward_gathers: float, backward_traffic: float, forward_s: float, backward_s: float,
                  first_gather: float, last_reduce: float) -> float:
    """Seconds of ZeRO-3's data-parallel traffic one micro-batch exposes, with each all-gather prefetched one layer
    ahead of the layer it feeds (PyTorch FSDP's ``forward_prefetch`` and ``backward_prefetch=BACKWARD_PRE``: the
    next layer's gather issued before the current layer's compute; DeepSpeed's prefetch likewise): a phase's
    traffic hides behind that phase's compute only, never behind the other's.  The forward's gathers behind the
    forward (at least the first gather, which nothing precedes); the backward's gathers and reduce-scatters behind
    the backward and the recomputation (at least the last reduce-scatter, which nothing follows).  For a model of
    equal layers this is the layer-by-layer count; an unbounded prefetch (every gather hidden by the whole step's
    compute) would hide a forward's excess behind the backward.

    >>> zero3_exposed(5.0, 4.0, 3.0, 6.0, 0.5, 0.25)  # the forward's gathers 2 s longer than its compute
    2.25
    >>> zero3_exposed(1.0, 1.0, 3.0, 6.0, 0.5, 0.25)  # all hidden: the first gather and the last reduce-scatter
    0.75
    """
    return max(forward_gathers - forward_s, first_gather) + max(backward_traffic - backward_s, last_reduce)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers.

    >>> ceil_div(61, 16)
    4
    """
    return -(-a // b)
