"""Pipeline schedules: the order in which each stage runs its (micro-batch, chunk, phase) tasks.

A pipeline of ``p`` stages cuts the model into ``p * v`` consecutive *chunks* (``v`` virtual
stages per stage, 1 unless interleaved); chunk ``c`` lives on stage ``c % p`` (Megatron-LM's
interleaved assignment: stage ``s`` holds chunks ``s, s + p, ..., s + (v - 1) p``).  A
batch is cut into ``m`` micro-batches; every micro-batch runs forward (``F``) through every
chunk in order, then backward (``B``) in reverse order.

Schedules (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21, section 2.2; the task orders follow Megatron-LM's
``forward_backward_pipelining_with(out)_interleaving``):

- ``gpipe`` (Huang et al., 2019): every forward, then every backward.  Each stage keeps the
  activations of all ``m`` micro-batches in flight.
- ``1f1b`` (PipeDream-Flush): stage ``s`` runs ``p - s - 1`` warm-up forwards, then
  alternates one forward and one backward, then drains the backwards; it keeps at most
  ``p - s`` micro-batches' activations (``min(p - s, m)``).
- ``interleaved`` (1F1B with ``v`` chunks a stage, ``m`` a multiple of ``p``): stage ``s``
  runs ``2 (p - s - 1) + (v - 1) p`` warm-up chunk-forwards (all ``m v`` when ``m == p``),
  then 1F1B over chunks.  Its peak is the warm-up plus one chunk-activation, i.e. on stage 0
  ``p + (p - 1) / v`` micro-batches' worth of a stage's activations (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022, section 4.2.3:
  ``L/p (1 + (p-1)/(p v))`` times ``p`` micro-batches).

The pipeline *bubble* (the paper's "bubble time fraction", idle time over ideal compute
time) is ``(p - 1) / m`` for GPipe and 1F1B and ``(p - 1) / (v m)`` interleaved
(:func:`bubble_fraction`); :func:`simulate` times the orders with given forward and backward
durations and measures it.

Examples
--------
>>> [str(t) for t in schedule("1f1b", stages=2, micro_batches=3)[0]]
['F0.0', 'F1.0', 'B0.0', 'F2.0', 'B1.0', 'B2.0']
>>> in_flight(schedule("1f1b", 4, 8)), in_flight(schedule("gpipe", 4, 8))
([4, 3, 2, 1], [8, 8, 8, 8])
>>> timeline = simulate(schedule("interleaved", 4, 8, 2), 4, 2)
>>> round(timeline.bubble, 6), bubble_fraction("interleaved", 4, 8, 2)
(0.1875, 0.1875)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layout_prop.core.errors import SpecError, cut
from layout_prop.io.spec_blocks import MAX_TASKS, SCHEDULES, check_schedule_request  # noqa: F401 (names of this module)

__all__ = ["Task", "SCHEDULES", "MAX_TASKS", "schedule", "gpipe", "one_f_one_b", "interleaved", "in_flight",
           "bubble_fraction", "simulate", "Timeline", "check_schedule_request"]

@dataclass(frozen=True, order=True)
class Task:
    """One task of a stage: ``phase`` (``'F'`` or ``'B'``) of ``chunk`` on ``micro_batch``."""

    micro_batch: int
    chunk: int
    phase: str

    def __str__(self) -> str:
        return f"{self.phase}{self.micro_batch}.{self.chunk}"

    def to_list(self) -> list:
        return [self.micro_batch, self.chunk, "forward" if self.phase == "F" else "backward"]


def gpipe(stages: int, micro_batches: int) -> list[list[Task]]:
    """Every forward of the stage's chunk, then every backward, micro-batches in order."""
    return [[Task(k, s, "F") for k in range(micro_batches)] + [Task(k, s, "B") for k in range(micro_batches)]
            for s in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Task]]:
    """PipeDream-Flush: ``p - s - 1`` warm-up forwards, one forward one backward, then the backwards."""
    out = []
    for s in range(stages):
        warmup = min(stages - s - 1, micro_batches)
        order = [Task(k, s, "F") for k in range(warmup)]
        for k in range(micro_batches - warmup):
            order += [Task(warmup + k, s, "F"), Task(k, s, "B")]
        order += [Task(k, s, "B") for k in range(micro_batches - warmup, micro_batches)]
        out.append(order)
    return out


def interleaved(stages: int, micro_batches: int, virtual_stages: int) -> list[list[Task]]:
    """Megatron-LM's interleaved 1F1B: ``virtual_stages`` chunks a stage (chunk ``s + j p``)."""
    p, v, m = stages, virtual_stages, micro_batches
    check_schedule_request("interleaved", p, m, v)
    total = m * v

    def task(k: int, phase: str, s: int) -> Task:
        in_group = k % (p * v)
        local = in_group // p
        if phase == "B":
            local = v - 1 - local
        return Task((k // (p * v)) * p + k % p, s + local * p, phase)

    out = []
    for s in range(p):
        warmup = total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)
        order = [task(k, "F", s) for k in range(warmup)]
        for k in range(total - warmup):
            order += [task(warmup + k, "F", s), task(k, "B", s)]
        order += [task(k, "B", s) for k in range(total - warmup, total)]
        out.append(order)
    return out


def schedule(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Task]]:
    """The task order of every stage (a list per stage) for schedule ``kind``."""
    check_schedule_request(kind, stages, micro_batches, virtual_stages)
    if kind == "gpipe":
        return gpipe(stages, micro_batches)
    if kind == "1f1b":
        return one_f_one_b(stages, micro_batches)
    return interleaved(stages, micro_batches, virtual_stages)


def in_flight(orders: list[list[Task]]) -> list[int]:
    """The most chunk-activations each stage holds at once: forwards run whose backward has not.

    (In micro-batches for one chunk a stage; divide by ``v`` for a stage's worth interleaved.)
    """
    peaks = []
    for order in orders:
        held = peak = 0
        for t in order:
            held += 1 if t.phase == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def bubble_fraction(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The paper's bubble time fraction: ``(p - 1) / m``, interleaved ``(p - 1) / (v m)``."""
    check_schedule_request(kind, stages, micro_batches, virtual_stages)
    return (stages - 1) / (virtual_stages * micro_batches)


@dataclass
class Timeline:
    """When each task ran (:func:`simulate`): ``start``/``end`` by (stage, task), the makespan,
    the ideal time (one stage's work without idling) and ``bubble = (makespan - ideal) / ideal``."""

    start: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)
    makespan: float = 0.0
    ideal: float = 0.0

    @property
    def bubble(self) -> float:
        return (self.makespan - self.ideal) / self.ideal

    def order(self) -> list[tuple[int, Task]]:
        """Every (stage, task) by start time (then stage): an order that respects every dependency."""
        return sorted(self.start, key=lambda st: (self.start[st], st[0]))


def simulate(orders: list[list[Task]], stages: int, virtual_stages: int = 1, t_forward=1.0,
             t_backward=2.0, t_move=0.0) -> Timeline:
    """Time the orders: a task starts when its stage is free and its inputs are there (``F(k, c)``
    after ``F(k, c-1)``; ``B(k, c)`` after ``B(k, c+1)`` and ``F(k, c)``), an input from another
    stage ``t_move`` later (a number, or a mapping ``{(chunk, phase): seconds}``: the moves into that
    task, 0 where absent; a key ``(chunk, phase, micro_batch)`` adds a move into that micro-batch's
    task alone, as a move sent once a step, before the last micro-batch's task).

    ``t_forward`` and ``t_backward`` are one stage's time for a whole micro-batch (a number: each
    chunk takes ``1/v`` of it), or a sequence of each chunk's own time (uneven stages).

    Raises ``SpecError`` (``bad-pipeline``) when the orders deadlock.
    """
    chunks = stages * virtual_stages

    def per_chunk(value) -> list[float]:
        if isinstance(value, (int, float)):
            return [value / virtual_stages] * chunks
        return [float(v) for v in value]

    duration = {"F": per_chunk(t_forward), "B": per_chunk(t_backward)}
    done: dict[tuple[int, int, str], float] = {}
    line = Timeline()
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s, order in enumerate(orders):
            while pos[s] < len(order):
                t = order[pos[s]]
                if t.phase == "F":
                    deps = [(t.micro_batch, t.chunk - 1, "F")] if t.chunk > 0 else []
                else:
                    deps = [(t.micro_batch, t.chunk, "F")]
                    if t.chunk < chunks - 1:
                        deps.append((t.micro_batch, t.chunk + 1, "B"))
                if any(d not in done for d in deps):
                    break
                move = (t_move.get((t.chunk, t.phase), 0.0) + t_move.get((t.chunk, t.phase, t.micro_batch), 0.0)
                        if isinstance(t_move, dict) else t_move)
                start = max([free[s]] + [done[d] + (move if d[1] % stages != s else 0.0) for d in deps])
                end = start + duration[t.phase][t.chunk]
                line.start[(s, t)], line.end[(s, t)] = start, end
                done[(t.micro_batch, t.chunk, t.phase)] = end
                free[s] = end
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(order[pos[s]]) for s, order in enumerate(orders) if pos[s] < len(order)}
            raise SpecError("bad-pipeline", f"the pipeline schedule deadlocks: stages wait on {stuck}",
                            hint="each stage must run a chunk's forward before its backward, in dependency order")
    line.makespan = max(free)
    line.ideal = max(sum(duration[t.phase][t.chunk] for t in order) for order in orders)
    return line
