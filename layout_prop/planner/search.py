"""The whole parallel configuration, searched and ranked by predicted step time (``plan --search``).

A candidate is a factorisation of the devices over data (``dp``), tensor (``tp``), context
(``cp``), expert (``ep``) and pipeline (``pp``) parallelism, with a ZeRO stage (0-3), a
recomputation mode (none, selective, full), a pipeline schedule (GPipe, 1F1B, interleaved
1F1B with ``v`` chunks a device) and a micro-batch size.

How a candidate is priced (not one whole-graph estimate per candidate):

1. The model's layers are recognised (:func:`recognise`): nodes named with a layer number
   (``l3_q``, ``layers.3.attn``) are grouped by it, each group's ops and shapes with the
   number taken out are its signature, and the model's family and sizes are read from its
   weights (a ``gen gpt``, ``gen llama`` or ``gen moe`` spec).
2. For each distinct (tp, cp, ep, micro-batch) the family's generator writes the model
   with one and with two layers on the mesh of one pipeline stage of one data-parallel
   replica, and :func:`layout_prop.perf.step.estimate_step` prices both (analysed with
   the backward and resharded, Megatron-style layouts); their difference is one layer, the
   rest is the embedding and the head.  Cached: a search evaluates each key once.
3. :mod:`layout_prop.perf.parallel` composes the step: the busiest stage's layers, the
   pipeline bubble of the schedule, the point-to-point transfers between stages, the
   data-parallel gradient synchronisation overlapped with the backward and its ZeRO
   variant, the gradient accumulation over micro-batches, the optimizer, recomputation; and
   the memory per rank: the ZeRO model states and the activations in flight.

The mapping of mesh axes onto the cluster is the order of the axes, outermost first
(:data:`DEFAULT_ORDER`: ``pp, dp, ep, cp, tp``): ranks are numbered row-major over that
order, so the last axis varies fastest and fills a node first (tensor parallelism inside a
node, then context or expert parallelism, data and pipeline parallelism across nodes when
a node is full).  ``--axis-order`` changes it; the layer axes (``ep, cp, tp``, those the
one-layer graph holds) stay innermost and in that order, so that the layer's collectives
span the same links as in the whole mesh.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from layout_prop.core import meta
from layout_prop.core.errors import SpecError, cut
from layout_prop.core.graph import Graph
from layout_prop.perf import parallel as par
from layout_prop.perf.clusters import Cluster
from layout_prop.perf.collectives import axis_span

__all__ = ["ModelShape", "ImportedModel", "is_imported", "Config", "Candidate", "SearchResult", "LayerCost", "recognise", "search", "enumerate_configs",
           "evaluate", "parse_axis_order", "parse_axes", "DEFAULT_ORDER", "InfeasibleSearch", "format_seconds",
           "format_bytes", "PART_NAMES", "widest_part"]

AXES = ("pp", "dp", "ep", "cp", "tp")
DEFAULT_ORDER = AXES
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 3, 4)
_TIME_PARTS = ("compute_s", "recompute_s", "comm_s", "p2p_s", "bubble_s", "accumulate_s", "grad_sync_exposed_s",
               "optimizer_s")
_LAYER_NUMBER = re.compile(r"^(.*?\D|)(\d+)(\D.*)$")


class InfeasibleSearch(SpecError):
    """No candidate fits the memory limit: ``least``, the least memory per rank found; ``config``, its configuration."""

    def __init__(self, message: str, least: float, config: "Config", limit: int):
        super().__init__("memory-infeasible", message,
                         hint="raise --memory-per-rank, add devices, or use a larger cluster profile")
        self.least, self.config, self.limit = least, config, limit


@dataclass(frozen=True)
class ModelShape:
    """What the search needs of a model: its family, its sizes and how many layers (and of how many shapes)."""

    family: str  # gpt, llama, moe
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    dtype: str
    vocab: int = 64
    kv_heads: int | None = None
    full: bool = True
    tie: bool = True
    experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    router: str = "softmax"
    capacity_factor: float | None = None
    capacity_scope: str = "global"
    dense_layers: int = 0  # MoE: the first layers have a dense MLP of dense_ffn (DeepSeek-V3's first 3)
    dense_ffn: int | None = None
    distinct_layers: int = 1
    builder: Callable[..., dict] | None = field(default=None, compare=False, repr=False)
    imported: "ImportedModel | None" = field(default=None, compare=False, repr=False)  # read from a model file

    @property
    def itemsize(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}.get(self.dtype, 4)

    sp: bool | None = None  # sequence parallelism asked of the model (None: the family's, as the generators write)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the activations between blocks are split on the sequence by tp (Megatron's sequence parallelism):
        ``sp`` when given, else the generators' (gen llama and gen moe write it, gen gpt not)."""
        return self.sp if self.sp is not None else self.family in ("llama", "moe")

    def spec(self, layers: int, tp: int, cp: int = 1, ep: int = 1, dp: int = 1, micro_batch: int = 1,
             dense: int | None = None) -> dict:
        """The spec of ``layers`` layers on the mesh (dp, cp or ep, tp) with ``micro_batch`` sequences a data rank,
        written by ``builder(model, layers=, tp=, cp=, ep=, dp=, micro_batch=)`` (the planner does not import the
        generators: ``layout_prop.commands.search.generator_spec`` is the ``gen`` one)."""
        if self.builder is None:
            raise SpecError("search-builder", f"no spec builder for the {self.family} model",
                            hint="give ModelShape a builder (layout_prop.commands.search.generator_spec)")
        kwargs = {} if dense is None else {"dense": dense}  # MoE: how many of the layers are dense (default the
        # model's own, at most ``layers``)
        return self.builder(self, layers=layers, tp=tp, cp=cp, ep=ep, dp=dp, micro_batch=micro_batch, **kwargs)

    def describe(self) -> str:
        text = (f"{self.family}{' (imported ' + self.imported.architecture + ')' if self.imported else ''}, "
                f"{self.layers} layer{'s' if self.layers != 1 else ''} ({self.distinct_layers} distinct shape"
                f"{'s' if self.distinct_layers != 1 else ''}), hidden {self.hidden}, heads {self.heads}, "
                f"ffn {self.ffn}, seq {self.seq}, {self.dtype}")
        if self.imported is not None and self.kv_heads not in (None, self.heads):
            text += f", {self.kv_heads} kv heads"
        if self.imported is not None:
            text += f", vocab {self.vocab}" + (", tied head" if self.tie else "")
        if self.family == "moe":
            text += (f", {self.experts} experts top-{self.top_k}, {self.shared_experts} shared, capacity factor "
                     f"{self.capacity_factor} ({self.capacity_scope})")
            if self.dense_layers:
                text += f", the first {self.dense_layers} dense (ffn {self.dense_ffn})"
        return text


@dataclass(frozen=True)
class Config:
    """One candidate configuration (degrees, ZeRO stage, recomputation, schedule, micro-batch)."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: str = "none"
    schedule: str = "1f1b"
    v: int = 1
    micro_batch: int = 1
    # the data-parallel gradient reduction overlapped with the backward in buckets (Megatron-LM's
    # --overlap-grad-reduce, PyTorch DDP's buckets); False: after the backward, as Megatron-LM's local DDP ran it in
    # 2021 (allreduce_gradients after the last micro-batch)
    overlap_grad_reduce: bool = True

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    def degree(self, axis: str) -> int:
        return getattr(self, axis)

    def label(self) -> str:
        sched = "-" if self.pp == 1 else (f"interleaved(v={self.v})" if self.schedule == "interleaved"
                                          else self.schedule)
        return (f"dp={self.dp} tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep} zero={self.zero} "
                f"recompute={self.recompute} schedule={sched} micro-batch={self.micro_batch}"
                + ("" if self.overlap_grad_reduce else " no-overlap"))

    def to_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "zero": self.zero,
                "recompute": self.recompute, "schedule": self.schedule if self.pp > 1 else None,
                "virtual_stages": self.v if self.schedule == "interleaved" else 1, "micro_batch": self.micro_batch}


@dataclass(frozen=True)
class LayerCost:
    """One layer and the rest (embedding, head, loss) on one stage's mesh, per micro-batch (seconds, bytes)."""

    forward_s: float
    backward_s: float
    comm_s: float  # exposed forward and backward collectives
    forward_comm_s: float
    attention_core_s: float  # forward time of the ops on (seq x seq) values: what selective recomputation redoes
    param_bytes: int  # this rank's local parameters
    param_tensors: int  # how many (each gradient is synchronised by its own collective, as the step model prices it)
    expert_param_bytes: int
    activation_bytes: int
    attention_core_bytes: int
    input_bytes: int  # the layer's input on this rank (what full recomputation keeps)
    flops: float  # forward and backward on every rank of the stage's mesh
    ep_sync_s: float  # gradient synchronisation on the ep axis (dense parameters of the expert ranks)
    backward_param_bytes: int = 0  # the parameters the backward reads (ZeRO-3 gathers them again for it)
    backward_param_tensors: int = 0
    # the parameters outside the layers that only the first stage holds (read before the layers: the embedding and
    # position embedding) and only the last (read after them: the final norm, an untied head); a tied embedding,
    # read by both, is on both stages (the pipelined program keeps a copy on each and synchronises both); as
    # (bytes, tensors, bytes and tensors the backward reads) each; zero for a layer
    first_param_bytes: int = 0
    first_param_tensors: int = 0
    first_backward_param_bytes: int = 0
    first_backward_param_tensors: int = 0
    last_param_bytes: int = 0
    last_param_tensors: int = 0
    last_backward_param_bytes: int = 0
    last_backward_param_tensors: int = 0


@dataclass
class Candidate:
    config: Config
    step_time_s: float
    memory_bytes: float
    tflops_per_device: float
    mfu: float
    parts: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "label": self.config.label(), "step_time_s": self.step_time_s,
                "memory_per_rank_bytes": int(self.memory_bytes), "tflops_per_device": self.tflops_per_device,
                "mfu": self.mfu, "breakdown": self.parts}


@dataclass
class SearchResult:
    model: ModelShape
    cluster: str
    devices: int
    global_batch: int
    memory_limit: int
    ranked: list[Candidate]  # feasible, best first
    candidates: int
    layer_evaluations: int
    seconds: float
    least_memory: Candidate | None = None
    notes: list[str] = field(default_factory=list)

    def ties(self) -> list[int]:
        """Indices of the candidates whose predicted step is within the model's error on its calibration set
        (:data:`~layout_prop.perf.calibration.CALIBRATION`, the mean absolute error) of the first's: the model
        cannot tell them apart (the first among them)."""
        from layout_prop.perf.calibration import CALIBRATION

        if not self.ranked:
            return []
        bound = self.ranked[0].step_time_s * (1 + CALIBRATION.mae)
        return [i for i, c in enumerate(self.ranked) if c.step_time_s <= bound]

    def preferred(self) -> int:
        """The index of the candidate the search prefers among :meth:`ties`: the fewest moving parts
        (:func:`moving_parts`), then the least memory, then the shortest step."""
        tied = self.ties()
        return min(tied, key=lambda i: (moving_parts(self.ranked[i].config), self.ranked[i].memory_bytes,
                                        self.ranked[i].step_time_s)) if tied else 0

    def uncertainty(self) -> str:
        """One line: the model's error, how many candidates it cannot tell from the first, which of them the
        search prefers and why."""
        from layout_prop.perf.calibration import CALIBRATION

        tied, best = self.ties(), self.preferred()
        head = f"within the model's error (mean {CALIBRATION.mae:.0%} on {CALIBRATION.rows} published runs) "
        if len(tied) <= 1:
            return head + "no other candidate ties with #1"
        if best == 0:
            return head + (f"#1 ties with {len(tied) - 1} other candidate{'s' if len(tied) > 2 else ''} (up to "
                           f"#{tied[-1] + 1}); the search prefers #1: none of them has fewer moving parts and less "
                           "memory")
        a, b = self.ranked[0], self.ranked[best]
        why = []
        if moving_parts(b.config) < moving_parts(a.config):
            why.append(f"fewer moving parts ({moving_parts(b.config)} against {moving_parts(a.config)}: "
                       f"{_parts_text(b.config)} against {_parts_text(a.config)})")
        if b.memory_bytes < a.memory_bytes:
            why.append(f"less memory ({_bytes_pair(b.memory_bytes, a.memory_bytes)} per rank)")
        return head + (f"#1 ties with {len(tied) - 1} other candidate{'s' if len(tied) > 2 else ''} (up to "
                       f"#{tied[-1] + 1}); the search prefers #{best + 1} ({b.config.label()}): "
                       f"{' and '.join(why)}, {format_seconds(b.step_time_s - a.step_time_s)} slower in the model")

    def why(self) -> str:
        """One line on why the first candidate beats the second: the part of the step that differs most."""
        if len(self.ranked) < 2:
            return "only one candidate fits"
        a, b = self.ranked[0], self.ranked[1]
        tie = b.step_time_s - a.step_time_s < 5e-8  # under 0.05 us: rounding, not a difference ("0.0 us faster")
        if tie and abs(b.memory_bytes - a.memory_bytes) <= 1:
            return f"#1 and #2 ({b.config.label()}) tie on step time and memory; the first enumerated is listed first"
        if tie and a.memory_bytes < b.memory_bytes:
            return (f"#1 and #2 ({b.config.label()}) tie on step time; #1 needs less memory "
                    f"({_bytes_pair(a.memory_bytes, b.memory_bytes)} per rank)")
        if tie:  # ranked on the step time first: #1's is shorter by less than the table shows ('tie on memory' said)
            return (f"#1 and #2 ({b.config.label()}) tie on step time; #2 needs less memory "
                    f"({_bytes_pair(b.memory_bytes, a.memory_bytes)} per rank), #1's step is "
                    f"{format_seconds(b.step_time_s - a.step_time_s)} shorter")
        key, gap = widest_part(a, b)
        return (f"#1 is {format_seconds(b.step_time_s - a.step_time_s)} faster than #2 ({b.config.label()}): "
                f"its {PART_NAMES.get(key, key)} is {format_seconds(gap)} shorter")


#: what each part of a candidate's step is, in words (:meth:`SearchResult.why`, benchmarks/published.py --rank)
PART_NAMES = {"compute_s": "compute", "bubble_s": "pipeline bubble", "comm_s": "exposed tensor/context/expert "
              "collectives", "p2p_s": "stage-to-stage transfers", "grad_sync_exposed_s": "exposed gradient sync",
              "optimizer_s": "optimizer", "recompute_s": "recomputation", "accumulate_s": "gradient accumulation"}


def widest_part(faster: Candidate, slower: Candidate) -> tuple[str, float]:
    """The part of the step (a key of :data:`PART_NAMES`) by which ``slower``'s is longest against ``faster``'s,
    and by how many seconds: the modelled effect that makes ``faster`` better."""
    diffs = {k: slower.parts.get(k, 0.0) - faster.parts.get(k, 0.0) for k in _TIME_PARTS}
    key = max(diffs, key=lambda k: diffs[k])
    return key, diffs[key]


def moving_parts(c: Config) -> int:
    """How many mechanisms a configuration runs beyond plain data parallelism: tensor, pipeline, context and
    expert parallelism, ZeRO, recomputation and an interleaved schedule count one each (fewer is simpler to run
    and to debug: the search's preference among candidates it cannot tell apart).

    >>> moving_parts(Config(dp=8, tp=1, pp=1)), moving_parts(Config(dp=2, tp=2, pp=2, zero=1, schedule="interleaved"))
    (0, 4)
    """
    return sum((c.tp > 1, c.pp > 1, c.cp > 1, c.ep > 1, c.zero > 0, c.recompute != "none",
                c.pp > 1 and c.schedule == "interleaved"))


def _parts_text(c: Config) -> str:
    parts = [f"{axis}={c.degree(axis)}" for axis in ("tp", "pp", "cp", "ep") if c.degree(axis) > 1]
    parts += [f"zero={c.zero}"] if c.zero else []
    parts += [f"recompute={c.recompute}"] if c.recompute != "none" else []
    parts += ["interleaved"] if c.pp > 1 and c.schedule == "interleaved" else []
    return ", ".join(parts) or "data parallel only"


def format_seconds(seconds: float) -> str:
    """A step time or a difference of two, in the unit that shows it: ms from a millisecond up (as large models'
    steps were always printed), us below, ns below a microsecond (``0.0 ms`` said nothing on small models).

    >>> format_seconds(12.3456), format_seconds(0.0123), format_seconds(4.2e-5), format_seconds(7e-9)
    ('12,345.6 ms', '12.3 ms', '42.0 us', '7.0 ns')
    >>> format_seconds(0.99996e-3)
    '1.0 ms'
    """
    if abs(seconds) >= 0.99995e-3:  # (999.96 us is '1.0 ms', not '1,000.0 us')
        return f"{seconds * 1e3:,.1f} ms"
    if abs(seconds) >= 0.99995e-6:
        return f"{seconds * 1e6:,.1f} us"
    return f"{seconds * 1e9:,.1f} ns"


#: binary units of :func:`format_bytes`, each 1024 times the last
_BYTE_UNITS = ("KiB", "MiB", "GiB")


def format_bytes(nbytes: float) -> str:
    """Memory per rank in the unit that shows it: GiB from one GiB up (as large models' memory was always printed),
    MiB and KiB below (no wider than ``1023.99 MiB``, the search's column), bytes below a KiB (``0.00 GiB`` said
    nothing on small models).

    >>> format_bytes(80 * 2**30), format_bytes(3.5 * 2**20), format_bytes(12_800), format_bytes(600)
    ('80.00 GiB', '3.50 MiB', '12.50 KiB', '600 bytes')
    >>> format_bytes(2**30 - 1)  # rounds up into the next unit's first value, not to '1024.00 MiB'
    '1.00 GiB'
    """
    if abs(nbytes) < 1023.5:  # 1023.5 bytes and up round to 1.00 KiB
        return f"{nbytes:,.0f} bytes"
    value, unit = nbytes / 1024, _BYTE_UNITS[0]
    for bigger in _BYTE_UNITS[1:]:
        if abs(value) < 1023.995:  # '1024.00' would be the next unit's 1.00
            break
        value, unit = value / 1024, bigger
    return f"{value:,.2f} {unit}" if unit == "GiB" else f"{value:.2f} {unit}"


def _bytes_pair(a: float, b: float) -> str:
    """``A against B UNIT``, each in :func:`format_bytes`'s unit (said once where both share it, as large models'
    pairs were printed in GiB); in bytes where both would print the same.

    >>> _bytes_pair(2**31, 3 * 2**30), _bytes_pair(12_800, 3 * 2**30), _bytes_pair(2**30, 2**30 + 8)
    ('2.00 against 3.00 GiB', '12.50 KiB against 3.00 GiB', '1,073,741,824 against 1,073,741,832 bytes')
    """
    first, second = format_bytes(a), format_bytes(b)
    if first == second:
        return f"{a:,.0f} against {b:,.0f} bytes"
    value, unit = first.rsplit(" ", 1)
    return f"{value} against {second}" if second.endswith(" " + unit) else f"{first} against {second}"


def _layer_groups(names: Iterable[str]) -> dict[str, dict[int, list[str]]]:
    """Node names grouped by (pattern with the number taken out) -> number -> names."""
    groups: dict[str, dict[int, list[str]]] = {}
    for name in names:
        m = _LAYER_NUMBER.match(name)
        if m:
            key = m.group(1) + "#"
            groups.setdefault(key, {}).setdefault(int(m.group(2)), []).append(m.group(1) + "#" + m.group(3))
    return groups


def recognise(graph: Graph) -> ModelShape:
    """The model's family, sizes and layers, read from a ``gen gpt|llama|moe`` spec's graph.

    The layers are the groups of nodes whose names carry the same number after the same
    prefix (the prefix with the most numbered groups); two layers are the same shape when
    their ops, the names with the number taken out and the input shapes agree.

    An imported model (``layout-prop import``'s graph, torch's module names) is read by
    :func:`_recognise_imported`: a decoder-only Llama-family or GPT-2 model, its sizes from its
    parameters' shapes and its reshapes into heads, priced as the ``gen`` model of those sizes.
    """
    if is_imported(graph):
        return _recognise_imported(graph)
    nodes = [n for n in graph.topo_order() if not n.is_input]
    groups = _layer_groups(n.name for n in nodes)
    if not groups:
        raise SpecError("no-layers", "the model has no repeated layers the search can recognise (no node named "
                        "with a layer number, like l0_q or layers.0.attn)",
                        hint="plan --search takes gen gpt, gen llama or gen moe specs")
    prefix = max(groups, key=lambda k: (len(groups[k]), sum(map(len, groups[k].values()))))
    layers = groups[prefix]
    shapes = {n.name: n for n in graph.topo_order()}

    stem = re.compile(re.escape(prefix.rstrip("#")) + r"(\d+)(?=\D)")

    def _operand(name: str, number: int) -> Any:
        if name in shapes and shapes[name].is_input:
            return tuple(shapes[name].attrs.get("shape", ()))
        hit = stem.match(name)
        if hit and int(hit.group(1)) == number:
            return "#" + name[hit.end():]
        return "<outside>"  # the previous layer's output, or the embedding's: the same to a layer

    def signature(number: int) -> tuple:
        sig = []
        for name in sorted(layers[number]):
            node = shapes.get(name.replace("#", str(number), 1))
            if node is None:
                continue
            ins = tuple(_operand(i, number) for i in node.inputs)
            sig.append((name, node.op, ins))
        return tuple(sig)

    distinct = len({signature(k) for k in layers})
    inputs = {n.name: n.attrs for n in graph.inputs()}
    stem_of = prefix.rstrip("#")
    # the weights are read through the nodes that use them (gen names its parameters as Hugging Face does and
    # its nodes l<i>_<what>): a layer's experts are the batched product e_gate_up_out, a dense MLP's gate the
    # linear l<i>_gate
    moe_numbers = sorted(k for k in layers if _weight(shapes, inputs, f"{stem_of}{k}_e_gate_up_out") is not None)
    dense_numbers = sorted(k for k in layers if _weight(shapes, inputs, f"{stem_of}{k}_gate") is not None)
    p = stem_of + str(moe_numbers[0] if moe_numbers else min(layers))

    def dims(node: str) -> list[int] | None:
        weight = _weight(shapes, inputs, p + "_" + node)
        return list(inputs[weight]["shape"]) if weight is not None else None

    def heads_of(proj: str) -> int | None:
        node = shapes.get(p + "_" + proj + "_heads")
        return int(node.attrs["shape"][2]) if node is not None and node.op == "reshape" else None

    seq = None
    for name in ("tokens", "x"):
        if name in inputs:
            seq = int(inputs[name]["shape"][1])
    if dims("e_gate_up_out"):  # the experts' fused gate and up, (E, 2F, H)
        family, ffn = "moe", dims("e_gate_up_out")[1] // 2
    elif dims("fc1_mm"):  # GPT-2's c_fc, Conv1D (H, F)
        family, ffn = "gpt", dims("fc1_mm")[1]
    elif dims("gate"):  # Llama's gate_proj, (F, H)
        family, ffn = "llama", dims("gate")[0]
    else:
        family = None
    heads = heads_of("q")
    norm_weight = _weight(shapes, inputs, p + "_h")
    norm = list(inputs[norm_weight]["shape"]) if norm_weight is not None else None
    if family is None or heads is None or norm is None or seq is None:
        raise SpecError("unknown-model", f"recognised {len(layers)} layers ({distinct} distinct shape(s)) named "
                        f"{prefix!r}, but not a gen gpt, llama or moe layer",
                        hint="plan --search evaluates layers with the gen generators: give a gen gpt, gen llama or "
                        "gen moe spec (imported models are not searched yet)")
    hidden = norm[0]
    dtype = inputs[norm_weight].get("dtype", "float32")
    embedding = next((n for n in graph.topo_order() if n.op == "embedding"), None)
    table = embedding.inputs[1] if embedding is not None and len(embedding.inputs) > 1 else None
    vocab = inputs[table]["shape"][0] if table in inputs else 64
    head = _weight(shapes, inputs, "logits")
    extra: dict[str, Any] = {}
    if family == "moe":
        experts = dims("e_gate_up_out")[0]
        topk = shapes.get(p + "_topk")
        shared = dims("s_gate_out")
        scores = shapes.get(p + "_scores")
        dispatch = shapes.get(p + "_dispatch")
        extra = dict(experts=experts, top_k=int(topk.attrs["k"]) if topk is not None else 1,
                     shared_experts=shared[0] // ffn if shared else 0,
                     router="sigmoid" if scores is not None and scores.op == "sigmoid" else "softmax",
                     capacity_factor=dispatch.attrs.get("capacity_factor") if dispatch is not None else None,
                     capacity_scope=dispatch.attrs.get("capacity_scope", "global") if dispatch is not None
                     else "global")
        if dense_numbers:
            if dense_numbers != list(range(min(layers), min(layers) + len(dense_numbers))):
                raise SpecError("unknown-model", f"the dense layers {dense_numbers} of the MoE model are not its first",
                                hint="plan --search takes gen moe --dense-layers N specs (the first N layers dense)")
            dense_gate = _weight(shapes, inputs, f"{stem_of}{dense_numbers[0]}_gate")
            extra.update(dense_layers=len(dense_numbers), dense_ffn=inputs[dense_gate]["shape"][0])
    return ModelShape(family=family, layers=len(layers), hidden=hidden, heads=heads, ffn=ffn, seq=seq, dtype=dtype,
                      vocab=vocab, kv_heads=heads_of("k") if family != "gpt" else None, full="tokens" in inputs,
                      tie=head is None or head == table, distinct_layers=distinct, **extra)


def _weight(nodes: dict, inputs: dict, name: str) -> str | None:
    """The parameter node ``name`` reads as its second operand (a product's weight, a norm's scale), or None when
    there is no such node or that operand is not a model input."""
    node = nodes.get(name)
    if node is None or node.is_input or len(node.inputs) < 2 or node.inputs[1] not in inputs:
        return None
    return node.inputs[1]


def _reads_as_gen(graph: Graph) -> bool:
    """Whether ``graph`` is laid out as ``gen gpt|llama|moe`` write it: decoder layers of nodes named ``l<i>_...``
    whose attention splits its query into heads at ``l<i>_q_heads`` after the norm ``l<i>_h`` (the node names the
    pipeline, recomputation and ZeRO passes read layers from; an importer names nodes after the model's modules)."""
    names = {n.name: n for n in graph.nodes}
    for name, node in names.items():
        hit = _GEN_HEADS.match(name)
        if hit and node.op == "reshape":
            norm = names.get(f"l{hit.group(1)}_h")
            if norm is not None and norm.op in ("rms_norm", "layer_norm"):
                return True
    return False


#: the node gen writes where a layer's query is split into heads
_GEN_HEADS = re.compile(r"^l(\d+)_q_heads$")


# ------------------------------------------------------------------------------------------ imported models
#: a layer-numbered parameter of an imported model: ``model.layers.3.self_attn.q_proj.weight``,
#: ``transformer.h.3.attn.c_attn.weight`` (torch's module names, as the importer keeps them)
_IMPORTED_LAYER = re.compile(r"^(?P<stem>(?:.+?\.)?(?:layers|layer|h|blocks|block))\.(?P<n>\d+)\.(?P<rest>.+)$")
#: torch module names of a decoder layer's projections, by role (Hugging Face's Llama, Qwen2, Mistral, Gemma,
#: Phi-3 and GPT-2, and Meta's Llama); GPT-2's ``c_proj`` is ``o`` under ``attn`` and ``down`` under ``mlp``
_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "wq": "q", "wk": "k", "wv": "v", "qkv_proj": "qkv",
          "c_attn": "qkv", "query_key_value": "qkv", "o_proj": "o", "wo": "o", "gate_proj": "gate", "w1": "gate",
          "up_proj": "up", "w3": "up", "gate_up_proj": "gate_up", "down_proj": "down", "w2": "down", "c_fc": "fc"}
_PARENT_ROLES = {("attn", "c_proj"): "o", ("mlp", "c_proj"): "down"}
_SUPPORTED = ("plan --search takes decoder-only imports of the Llama family (Llama, Qwen2, Mistral, Gemma, Phi-3: "
              "q_proj/k_proj/v_proj or qkv_proj, o_proj, gate_proj/up_proj or gate_up_proj, down_proj) and GPT-2 "
              "(h.N.attn.c_attn, c_proj, mlp.c_fc, c_proj), with torch's module names, and gen gpt|llama|moe specs")


@dataclass(frozen=True)
class ImportedModel:
    """What the search keeps of an imported model besides its sizes: what the generator's graph it is priced with
    leaves out (``differences``), the role of each projection parameter (``roles``: name -> q, k, v, qkv, o, gate,
    up, gate_up, down, fc, embed, head, or ROLE_bias) for a sharding plan in the model's own names, and its token
    input (name and shape)."""

    architecture: str  # "Llama-family" or "GPT-2"
    differences: tuple[str, ...]
    roles: tuple[tuple[str, str], ...]
    layer_stem: str  # "model.layers"
    token_input: tuple[str, tuple[int, ...]] | None

    def note(self, family: str) -> str:
        """The one note line: what the ``gen`` graph the model is priced with leaves out."""
        what = "; ".join(self.differences) if self.differences else "nothing the generator leaves out was found"
        return (f"imported {self.architecture} model priced as a gen {family} of the same sizes: "
                + (f"the import's {what} differ" if self.differences else what))


def is_imported(graph: Graph) -> bool:
    """Whether ``graph`` was read from a model file (the importer's notes), or names its parameters as torch does
    and is not laid out as gen writes its specs (gen names its parameters as Hugging Face's models do too: its
    graphs are told by their layers' node names and structure, :func:`_reads_as_gen`)."""
    if meta.IMPORT_NOTES in graph.meta:
        return True
    if _reads_as_gen(graph):
        return False
    return any(_IMPORTED_LAYER.match(n.name) for n in graph.inputs())


def _role(rest: str) -> tuple[str | None, str]:
    """``self_attn.q_proj.weight`` -> ``("q", "weight")``; unknown modules -> ``(None, kind)``."""
    parts = rest.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return None, parts[-1]
    module, parent = parts[-2], parts[-3] if len(parts) > 2 else ""
    return _PARENT_ROLES.get((parent, module), _ROLES.get(module)), parts[-1]


def _in_out(graph: Graph, weight: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """A projection weight's (input, output) features, from the product that reads it (an ONNX MatMul's weight is
    ``(in, out)``, or ``(out, in)`` read transposed; a ``linear`` weight ``(out, in)``)."""
    if len(shape) != 2:
        return None
    for node, index in graph.consumers(weight):
        if node.op == "matmul" and index == 1:
            return (shape[1], shape[0]) if node.attrs.get("transpose_b") else (shape[0], shape[1])
        if node.op == "linear" and index == 1:
            return shape[1], shape[0]
    return None


def _head_reshapes(graph: Graph, weight: str, depth: int = 8) -> list[tuple[int, int]]:
    """``(heads, head_dim)`` of each 4-d reshape ``(batch, seq, heads, head_dim)`` reached from the products that
    read ``weight`` (through adds, slices, splits, 3-d reshapes), stopping at another product or attention."""
    stop = {"matmul", "linear", "batch_matmul", "input"} | set(_ATTENTION_OPS)
    frontier = [node.outputs[0] for node, index in graph.consumers(weight) if node.op in ("matmul", "linear")]
    seen: set[str] = set()
    found = []
    for _ in range(depth):
        following = []
        for value in frontier:
            for node, _ in graph.consumers(value):
                if node.name in seen or node.op in stop:
                    continue
                seen.add(node.name)
                shape = node.attrs.get("shape") if node.op == "reshape" else None
                if shape is not None and len(shape) == 4:
                    found.append((int(shape[2]), int(shape[3])))
                    continue
                following.extend(node.outputs)
        frontier = following
    return found


#: the fused attention ops an imported decoder may hold: layout-prop's own (ONNX's attention pattern, a MindIR
#: matmul-softmax pattern) and MindSpore's FlashAttentionScore (MindIR import)
_ATTENTION_OPS = ("scaled_dot_product_attention", "flash_attention_score")
#: FlashAttentionScore's sparse modes that are causal: 2 (leftUpCausal) and 3 (rightDownCausal)
_CAUSAL_SPARSE_MODES = (2, 3)


def _causal(node) -> bool:
    """Whether an attention node of :data:`_ATTENTION_OPS` masks the future (a decoder's self-attention)."""
    if node.op == "flash_attention_score":
        return node.attrs.get("sparse_mode") in _CAUSAL_SPARSE_MODES
    return bool(node.attrs.get("causal"))


def _unknown(found: str, missing: list[str]) -> SpecError:
    return SpecError("unknown-model", f"the imported model is not one the search can price: {found}; missing: "
                     f"{'; '.join(missing)}", hint=_SUPPORTED)


def _recognise_imported(graph: Graph) -> ModelShape:
    """The sizes of an imported decoder-only model (Llama family, GPT-2), read from its parameter names and shapes
    and the importer's graph; what the ``gen`` generator of its family cannot write goes in the differences."""
    inputs = {n.name: n.attrs for n in graph.inputs()}
    params = {name: a for name, a in inputs.items() if a.get("requires_grad")}
    stems: dict[str, dict[int, dict[str, str]]] = {}
    for name in params:
        hit = _IMPORTED_LAYER.match(name)
        if hit:
            stems.setdefault(hit.group("stem"), {}).setdefault(int(hit.group("n")), {})[hit.group("rest")] = name
    if not stems:
        raise _unknown("no parameter is named with a layer number", [
            "parameters named like model.layers.N.self_attn.q_proj.weight or transformer.h.N.attn.c_attn.weight "
            "(an exporter that renames weights, like TorchScript's onnx::MatMul_N, leaves no module names)"])
    stem = max(stems, key=lambda s: (len(stems[s]), sum(map(len, stems[s].values()))))
    layers = stems[stem]
    numbers = sorted(layers)
    found = f"{len(numbers)} layer{'s' if len(numbers) != 1 else ''} named {stem}.N"
    attention = [n for n in graph.nodes if n.op in _ATTENTION_OPS]
    missing = []
    if not attention:
        missing.append("a fused attention (scaled_dot_product_attention or flash_attention_score; see import's "
                       "notes on what was left unfused)")
    elif not all(_causal(n) for n in attention):
        missing.append(f"causal attention: node {next(n.name for n in attention if not _causal(n))!r} "
                       "is not causal (an encoder or a cross-attention: not decoder-only)")
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        missing.append(f"consecutive layer numbers (found {numbers})")
    experts = sorted({n for k in numbers for n in layers[k].values() if ".experts." in n or "block_sparse_moe" in n})
    routing = sorted({n.op for n in graph.nodes if n.op in ("topk", "moe_dispatch", "moe_combine")})
    if experts or routing:  # the dense generators would price one expert as the MLP: refused, not approximated
        missing.append("a dense MLP: this is a Mixture-of-Experts model ("
                       + (f"{experts[0]}" if experts else f"{', '.join(routing)} ops")
                       + "), which only gen moe specs are searched as")

    def roles_of(number: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for rest, name in sorted(layers[number].items()):
            role, kind = _role(rest)
            if role is not None:
                key = role if kind == "weight" else role + "_bias"
                if key in out:  # two modules of one role in a layer: not a layer the generators write
                    raise _unknown(found, [f"one {key} projection a layer ({out[key][0]} and {name})"])
                out[key] = (name, tuple(params[name]["shape"]))
        return out

    first = roles_of(numbers[0])
    have = set(first)
    if not ({"q", "k", "v"} <= have or "qkv" in have):
        missing.append("q, k, v projections (q_proj, k_proj, v_proj; or a fused qkv_proj, c_attn)")
    if "o" not in have:
        missing.append("the attention's output projection (o_proj; GPT-2's attn.c_proj)")
    if not ({"gate", "up"} <= have or "gate_up" in have or "fc" in have):
        missing.append("the MLP's gate and up (gate_proj, up_proj; gate_up_proj) or GPT-2's mlp.c_fc")
    if "down" not in have:
        missing.append("the MLP's down projection (down_proj; GPT-2's mlp.c_proj)")
    if missing:
        raise _unknown(found, missing)

    def dims(role: str) -> tuple[int, int]:
        name, shape = first[role]
        got = _in_out(graph, name, shape)
        if got is None:
            raise _unknown(found, [f"a product reading {name} (shape {list(shape)}) as a weight"])
        return got

    fused = "qkv" in first
    hidden, q_out = dims("qkv" if fused else "q")
    reshapes = _head_reshapes(graph, first["qkv" if fused else "q"][0])
    head_dims = {d for _, d in reshapes}
    if len(head_dims) != 1:
        raise _unknown(found, [f"the reshape of the {'qkv' if fused else 'q'} projection into heads (batch, seq, "
                               f"heads, head_dim) after {first['qkv' if fused else 'q'][0]}"
                               + (f" (found head dims {sorted(head_dims)})" if head_dims else "")])
    head_dim = head_dims.pop()
    differences = []
    if fused:
        total = q_out // head_dim
        counts = sorted({n for n, _ in reshapes})
        heads = counts[-1]
        kv_heads = (total - heads) // 2
        if heads + 2 * kv_heads != total or kv_heads < 1:
            raise _unknown(found, [f"q, k and v heads of {head_dim} fused into {q_out} features (the reshapes give "
                                   f"heads {counts})"])
    else:
        heads = q_out // head_dim
        kv_heads = dims("k")[1] // head_dim
    if "gate_up" in first:
        ffn = dims("gate_up")[1] // 2
        differences.append("fused gate_up_proj (priced as gate and up projections)")
    else:
        ffn = dims("gate" if "gate" in first else "fc")[1]
    family = "llama" if ("gate" in first or "gate_up" in first) else "gpt"
    if fused and family == "llama":  # gen gpt writes GPT-2's fused c_attn itself; gen llama q, k, v apart
        differences.insert(0, f"fused {first['qkv'][0].rsplit('.', 2)[-2]} (priced as q, k, v projections)")
    down_in = dims("down")[0]
    if down_in != ffn:
        raise _unknown(found, [f"an MLP whose down projection reads its {ffn} features (it reads {down_in})"])
    if heads * head_dim != hidden:
        differences.append(f"attention width {heads} heads x {head_dim} = {heads * head_dim} (not hidden {hidden}: "
                           f"priced with head dim {hidden // heads if hidden % heads == 0 else '?'})")
        if hidden % heads:
            raise _unknown(found, [f"heads ({heads}) dividing hidden ({hidden}), as the generator writes them"])
    if family == "gpt" and kv_heads != heads:
        raise _unknown(found, [f"as many k/v heads as q heads in a GPT-2 layer ({kv_heads} against {heads})"])

    # the layers' shapes: how many distinct
    signatures = {tuple(sorted((r, s) for r, (_, s) in roles_of(k).items() if not r.endswith("_bias")))
                  for k in numbers}  # weights only: an exporter de-duplicates equal biases across layers
    # the embedding, the head, the token input
    ops = {n.op for n in graph.nodes}
    embedding = next((n for n in graph.topo_order() if n.op == "embedding"), None)
    token_input, seq, vocab, tie, table = None, None, 64, True, None
    if embedding is not None:
        table = embedding.inputs[1]
        vocab = int(inputs[table]["shape"][0]) if table in inputs else 64
        source = embedding.inputs[0]
        while source not in inputs and graph.producer(source)[0].op in ("reshape", "cast", "unsqueeze"):
            source = graph.producer(source)[0].inputs[0]
        if source in inputs:
            token_input = (source, tuple(inputs[source]["shape"]))
            seq = int(token_input[1][-1])
    else:
        streams = [(name, a) for name, a in inputs.items()  # a block's hidden states (batch, seq, hidden)
                   if len(a.get("shape", ())) == 3 and a["shape"][-1] == hidden and not _IMPORTED_LAYER.match(name)]
        if streams:
            token_input = (streams[0][0], tuple(streams[0][1]["shape"]))
            seq = int(token_input[1][1])
    if seq is None:
        raise _unknown(found, ["the token ids (an integer input read by the embedding) or a (batch, seq, hidden) "
                               "input, for the sequence length"])
    roles = [(name, role) for k in numbers for role, (name, _) in sorted(roles_of(k).items())
             if not role.endswith("_bias")]
    # a bias by the product it is added to, named as its weight (an exporter may store equal biases as one tensor
    # under one of their names: the plan names each by its own, which the importer matches to the shared tensor)
    roles += [(name[:-len("weight")] + "bias", role + "_bias") for name, role in list(roles)
              if name.endswith(".weight") and _bias_of(graph, name, inputs)]
    head = None
    for node in graph.topo_order():  # the head: a product reading the vocabulary out of the hidden size
        if node.op in ("matmul", "linear") and len(node.inputs) > 1 and node.inputs[1] in params:
            got = _in_out(graph, node.inputs[1], tuple(inputs[node.inputs[1]]["shape"]))
            if got == (hidden, vocab) and not _IMPORTED_LAYER.match(node.inputs[1]):
                head = node.inputs[1]
    if table is not None and table in params:
        roles.append((table, "embed"))
    if head is not None:
        roles.append((head, "head"))
        tie = table is not None and head in (table, table + ".T")
    dtype = str(params[first["qkv" if fused else "q"][0]].get("dtype", "float32"))

    # what the generator of the family does not write
    biases = sorted({role for k in numbers for role, (name, _) in roles_of(k).items()
                     if not role.endswith("_bias") and _bias_of(graph, name, inputs)})
    if family == "llama":
        if biases:
            differences.append(f"biases on {', '.join(biases)}")
        if "rms_norm" not in ops:
            differences.append("LayerNorm (the generator writes RMSNorm)")
        if "rotary_position_embedding" not in ops:
            differences.append("no rotary position embedding")
        gate_ops = _ops_after(graph, first["gate_up" if "gate_up" in first else "gate"][0])
        if "silu_mul" not in gate_ops:
            act = sorted(gate_ops & {"gelu", "relu", "sigmoid", "tanh", "silu", "opaque"})
            differences.append(f"gated MLP activation {'/'.join(act) or 'not SiLU'} (the generator writes SwiGLU)")
    else:
        gen_biases = ["down", "fc", "o", "q", "v"]
        if biases != gen_biases and not (fused and biases == sorted(["down", "fc", "o", "qkv"])):
            differences.append(f"biases on {', '.join(biases) or 'no projection'} (gen gpt's: q, v, o, fc1, fc2)")
        if "dropout" not in ops:
            differences.append("no dropout (gen gpt writes dropout 0.1, priced)")
        if not tie:
            differences.append("an untied head (gen gpt ties it to the embedding)")
    norms = [n for n in graph.nodes if n.op in ("rms_norm", "layer_norm")]
    computed = sorted({n.inputs[1] for n in norms if len(n.inputs) > 1 and n.inputs[1] not in params})
    if computed:
        differences.append(f"norm weights that are constants, not parameters ({', '.join(computed[:3])}: Gemma's "
                           "1 + w, folded by the exporter)")
    if embedding is not None and {c.op for c, _ in graph.consumers(embedding.outputs[0])} & {"mul", "div", "scale"}:
        differences.append("scaled embeddings")
    if embedding is not None and not any(op.startswith("cross_entropy") for op in ops):
        differences.append("loss (the import ends at its outputs; the generator's vocab-parallel cross entropy is "
                           "priced)")
    architecture = "Llama-family" if family == "llama" else "GPT-2"
    imported = ImportedModel(architecture=architecture, differences=tuple(differences), roles=tuple(roles),
                             layer_stem=stem, token_input=token_input)
    return ModelShape(family=family, layers=len(numbers), hidden=hidden, heads=heads, ffn=ffn, seq=seq, dtype=dtype,
                      vocab=vocab, kv_heads=kv_heads if family != "gpt" else None, full=embedding is not None,
                      tie=tie, distinct_layers=len(signatures), imported=imported)


def _products(graph: Graph, weight: str) -> list:
    return [node for node, index in graph.consumers(weight) if node.op in ("matmul", "linear") and index == 1]


def _bias_of(graph: Graph, weight: str, inputs: dict) -> str | None:
    """The 1-d input added to the product of ``weight`` (a linear's third operand, or an ``add`` right after it)."""
    for node in _products(graph, weight):
        if node.op == "linear" and len(node.inputs) > 2:
            return node.inputs[2]
        for user, index in graph.consumers(node.outputs[0]):
            other = user.inputs[1 - index] if user.op == "add" and len(user.inputs) == 2 else None
            if other in inputs and len(inputs[other].get("shape", ())) == 1:
                return other
    return None


def _ops_after(graph: Graph, weight: str, depth: int = 3) -> set[str]:
    """The ops within ``depth`` steps after the products of ``weight`` (not past another product)."""
    frontier = [n.outputs[0] for n in _products(graph, weight)]
    ops: set[str] = set()
    for _ in range(depth):
        following = []
        for value in frontier:
            for node, _ in graph.consumers(value):
                if node.op not in ("matmul", "linear"):
                    ops.add(node.op)
                    following.extend(node.outputs)
        frontier = following
    return ops


def parse_axis_order(text: str | None) -> tuple[str, ...]:
    """``--axis-order``: the mesh axes outermost first, a permutation of pp, dp, ep, cp, tp, the layer axes innermost.

    >>> parse_axis_order(None), parse_axis_order("dp,pp,ep,cp,tp")
    (('pp', 'dp', 'ep', 'cp', 'tp'), ('dp', 'pp', 'ep', 'cp', 'tp'))
    """
    if text is None:
        return DEFAULT_ORDER
    order = tuple(a.strip() for a in text.split(",") if a.strip())
    if sorted(order) != sorted(AXES):
        raise SpecError("bad-axis-order", f"--axis-order {text!r} is not an order of {', '.join(AXES)}",
                        hint="name every axis once, outermost first, like pp,dp,ep,cp,tp")
    if order[2:] != ("ep", "cp", "tp"):
        raise SpecError("bad-axis-order", f"--axis-order {text!r} does not keep ep, cp, tp innermost in that order",
                        hint="the one-layer graph holds ep, cp and tp: order pp and dp as you like before them, "
                        "like dp,pp,ep,cp,tp")
    return order


def parse_axes(text: str | None) -> dict[str, int]:
    """``--axes``: degrees the search keeps fixed, like ``tp=8,pp=8``.

    >>> parse_axes("tp=8, pp=4")
    {'tp': 8, 'pp': 4}
    """
    fixed: dict[str, int] = {}
    if not text:
        return fixed
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        value = value.strip()
        # ASCII digits only ('²' and '٢' pass isdigit), and few of them (int() refuses 4,300 digits)
        if not sep or name not in AXES or not (value.isascii() and value.isdigit() and len(value) <= 18) \
                or int(value) < 1:
            raise SpecError("bad-axes", f"--axes entry {cut(part.strip(), 60)} is not AXIS=N with AXIS one of "
                            f"{', '.join(AXES)} and N >= 1 in ASCII digits", hint="write --axes tp=8,pp=8")
        if name in fixed and fixed[name] != int(value):
            raise SpecError("bad-axes", f"--axes gives {name} twice ({name}={fixed[name]} and {part.strip()})",
                            hint="give each axis once, like --axes tp=8,pp=8")
        fixed[name] = int(value)
    return fixed


#: the most devices plan --search takes (2^24: the largest published clusters hold about 10^5 accelerators;
#: the divisors of a count this size are found in at most 4,096 trial divisions)
MAX_DEVICES = 2 ** 24


def _divisors(n: int, up_to: int) -> list[int]:
    """The divisors of ``n`` no larger than ``up_to``, ascending, from ``n``'s prime factors found
    by trial division up to ``min(sqrt(n), up_to)`` (a cluster of 10^9 devices a node or 10^9
    experts took 61 s counting every number up to it).

    >>> _divisors(12, 6), _divisors(2 ** 40, 10 ** 9)[-1], len(_divisors(7, 10 ** 18))
    ([1, 2, 3, 4, 6], 536870912, 2)
    """
    factors: dict[int, int] = {}
    rest, p = n, 2
    while p * p <= rest and p <= up_to:  # (a prime past up_to divides no divisor wanted)
        while rest % p == 0:
            factors[p] = factors.get(p, 0) + 1
            rest //= p
        p += 1 if p == 2 else 2
    if 1 < rest <= up_to and p * p > rest:  # what is left is a prime
        factors[rest] = factors.get(rest, 0) + 1
    divisors = [1]
    for prime, power in factors.items():
        divisors = [d * prime ** k for d in divisors for k in range(power + 1) if d * prime ** k <= up_to]
    return sorted(divisors)


def enumerate_configs(model: ModelShape, devices: int, global_batch: int, cluster: Cluster,
                      fixed: dict[str, int] | None = None) -> list[Config]:
    """Every candidate configuration of ``devices`` for ``model`` (refused with a typed error when none exists)."""
    fixed = fixed or {}
    product = math.prod(fixed.values())
    if devices % product:
        raise SpecError("bad-devices", f"{devices:,} devices are not a product of the fixed degrees "
                        f"{' x '.join(f'{k}={v}' for k, v in fixed.items())} (= {product:,}) and the others",
                        hint="fix degrees whose product divides --devices")
    kv = model.kv_heads or model.heads
    tps = [t for t in _divisors(devices, cluster.devices_per_node) if model.heads % t == 0 and kv % t == 0
           and model.ffn % t == 0 and model.hidden % t == 0]
    cps = [c for c in _divisors(devices, 16) if model.family != "moe" and model.seq % c == 0 and c <= 16] \
        if model.family != "moe" else [1]
    eps = [e for e in _divisors(devices, model.experts) if model.experts % e == 0] if model.family == "moe" else [1]
    pps = _divisors(devices, model.layers)
    configs: list[Config] = []
    batch_refusals = 0
    for tp, cp, ep, pp in itertools.product(tps, cps, eps, pps):
        degrees = {"tp": tp, "cp": cp, "ep": ep, "pp": pp}
        if model.sequence_parallel and model.seq % (tp * cp):
            continue
        if any(axis in fixed and fixed[axis] != value for axis, value in degrees.items()):
            continue
        rest = devices // (tp * cp * ep * pp)
        if devices % (tp * cp * ep * pp) or ("dp" in fixed and fixed["dp"] != rest):
            continue
        data = rest * ep  # the batch is split over dp and ep (the expert ranks are data parallel outside the experts)
        for mb in MICRO_BATCHES:
            if global_batch % (mb * data):
                batch_refusals += 1
                continue
            m = global_batch // (mb * data)
            schedules = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)] + [
                ("interleaved", v) for v in VIRTUAL_STAGES if model.layers % (pp * v) == 0 and m % pp == 0]
            for (schedule, v), zero, recompute in itertools.product(schedules, par.ZERO_STAGES, par.RECOMPUTE_MODES):
                if zero and rest == 1:
                    continue  # nothing to shard the states over
                configs.append(Config(dp=rest, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, recompute=recompute,
                                      schedule=schedule, v=v, micro_batch=mb))
    if not configs:
        if batch_refusals:
            raise SpecError("bad-batch", f"global batch {global_batch:,} is not a multiple of micro-batch x "
                            f"data-parallel degree for any factorisation of {devices:,} devices "
                            f"(micro-batches {', '.join(map(str, MICRO_BATCHES))})",
                            hint="give a global batch that the data-parallel degrees divide, e.g. a power of two")
        raise SpecError("no-factorisation", f"no factorisation of {devices:,} devices over dp, tp, cp, ep, pp fits "
                        f"the model ({model.describe()}; tp at most {cluster.devices_per_node} and dividing the "
                        f"heads, pp at most the layers)" + (f" with {parse_axes_text(fixed)}" if fixed else ""),
                        hint="choose a device count with small prime factors, or other fixed degrees")
    return configs


def parse_axes_text(fixed: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items())


class LayerCache:
    """One-layer estimates by (tp, cp, ep, micro-batch): each key evaluated once.

    ``analyse(spec) -> Graph`` loads a spec and analyses it with its backward, resharded
    (``layout_prop.commands.search.analysed``: the planner may not import the API).
    """

    def __init__(self, model: ModelShape, cluster: Cluster, analyse: Callable[[dict], Graph]):
        self.model, self.cluster, self.analyse = model, cluster, analyse
        self.costs: dict[tuple[int, int, int, int], tuple[LayerCost, LayerCost, LayerCost | None]] = {}
        self.evaluations = 0

    def _measure(self, layers: int, dense: int, key: tuple[int, int, int, int]) -> LayerCost:
        tp, cp, ep, mb = key
        self.evaluations += 1
        graph = self.analyse(self.model.spec(layers, tp, cp, ep, 1, mb, dense=dense))
        return _measure(self.model, graph, self.cluster)

    def get(self, tp: int, cp: int, ep: int, mb: int) -> tuple[LayerCost, LayerCost, LayerCost | None]:
        """``(layer, rest, dense)``: one layer (the model's main shape), the embedding and head, and one of a MoE
        model's first dense layers (None without them), each shape priced once."""
        key = (tp, cp, ep, mb)
        if key not in self.costs:
            one = self._measure(1, 0, key)
            two = self._measure(2, 0, key)
            boundary = boundary_bytes(self.model, tp, cp, mb)
            layer = replace(_difference(two, one), input_bytes=boundary)
            rest = LayerCost(*[a - (b - a) for a, b in zip(_fields(one), _fields(two))])
            dense = None
            if self.model.dense_layers:  # the first layer dense, the second not: minus one main layer and the rest
                dense = replace(_difference(self._measure(2, 1, key), one), input_bytes=boundary)
            analytic = korthikanti_bytes(self.model, tp, cp, mb)
            if analytic is not None:  # the stored activations as Korthikanti et al. count them, the core measured
                layer = replace(layer, activation_bytes=int(analytic) + layer.attention_core_bytes)
            self.costs[key] = (layer, rest, dense)
        return self.costs[key]


def korthikanti_bytes(model: ModelShape, tp: int, cp: int, micro_batch: int) -> float | None:
    """A dense layer's stored activations besides the attention core, per micro-batch on one rank, as Korthikanti et
    al. 2022 count them (:func:`layout_prop.perf.parallel.layer_activation_bytes`: GPT with its dropouts, Llama
    gated and with grouped key/value heads, no dropout; split by tp with sequence parallelism, the sequence by
    cp); None for a MoE model (its expert buffers are the graph's).  The generators' graphs save more than
    Megatron-LM does (gen llama normalises the whole gathered sequence on every tp rank and keeps it), which put
    a 405B Llama layer at 1.40 GiB where this count is 0.50 GiB (tp 8, sequence 8,192)."""
    if model.family not in ("gpt", "llama"):
        return None
    return par.layer_activation_bytes(model.seq // cp, micro_batch, model.hidden, model.heads, model.ffn, tp,
                                      kv_heads=model.kv_heads, gated=model.family == "llama",
                                      dropout=model.family == "gpt", sequence_parallel=model.sequence_parallel,
                                      itemsize=model.itemsize)


def _difference(a: LayerCost, b: LayerCost) -> LayerCost:
    return LayerCost(*[x - y for x, y in zip(_fields(a), _fields(b))])


def _fields(cost: LayerCost) -> list:
    return [getattr(cost, f) for f in LayerCost.__dataclass_fields__]


def _measure(model: ModelShape, graph: Graph, cluster: Cluster) -> LayerCost:
    """The step model's figures of an analysed graph (one micro-batch): the basis of a layer's cost."""
    from layout_prop.core import meta
    from layout_prop.passes.propagate import value_spec
    from layout_prop.perf.costs import op_cost, op_time
    from layout_prop.perf.step import estimate_step

    est = estimate_step(graph, cluster)
    comm = sum(sum(k.values()) for k in est.communication.values())
    mesh = graph.mesh
    ep_axis = mesh.names.index("ep") if "ep" in mesh.names else None
    params = [n.name for n in graph.inputs() if n.attrs.get("requires_grad")]
    param_bytes = expert_bytes = 0
    for name in params:
        spec_ = value_spec(graph, name)
        nbytes = spec_.local_nbytes(0)
        param_bytes += nbytes
        if ep_axis is not None and spec_.layout.placements[ep_axis].is_shard():
            expert_bytes += nbytes
    core_s, core_bytes = 0.0, 0
    seq = model.seq
    for node in graph.topo_order():
        if node.is_input or node.op == "redistribute" or node.name.startswith("grad/"):
            continue
        if node.meta.get(meta.INSERTED_BY) == "backward":
            continue
        specs = node.meta.get(meta.SPECS)
        if not specs or None in specs:
            continue
        if any(len(s.shape) == 4 and s.shape[1] == model.heads and s.shape[-1] == seq and s.shape[-2] == seq
               for s in specs):  # attention scores and probabilities (batch, heads, seq, seq)
            inputs = [value_spec(graph, v) for v in node.inputs]
            if any(s is None for s in inputs):
                continue
            cost = op_cost(node.op, [s.local_shape(0) for s in inputs], [s.local_shape(0) for s in specs],
                           [s.itemsize for s in inputs], [s.itemsize for s in specs],
                           node.meta.get(meta.ATTRS, node.attrs), dtype=inputs[0].dtype if inputs else specs[0].dtype)
            core_s += op_time(cost, cluster)
            # the bytes selective recomputation frees: the scores and probabilities the backward reads, not every
            # (batch, heads, seq, seq) value (the scores before the softmax are not kept: subtracting them too
            # left a 530B GPT layer 6.4 sbh bytes kept instead of about 32, Korthikanti et al.'s 34)
            core_bytes += sum(s.local_nbytes(0) for v, s in zip(node.outputs, specs)
                              if any(_is_backward(consumer) for consumer, _ in graph.consumers(v)))
    activations = _saved_bytes(graph)
    read_back = _backward_read(graph, params)
    act_in = 0  # set by the cache from the micro-batch (a layer's input: _boundary_bytes)
    ends = _end_parameters(graph, params)

    def sizes(names: list[str]) -> dict[str, int]:
        back = [name for name in names if name in read_back]
        return {"param_bytes": sum(value_spec(graph, name).local_nbytes(0) for name in names),
                "param_tensors": len(names),
                "backward_param_bytes": sum(value_spec(graph, name).local_nbytes(0) for name in back),
                "backward_param_tensors": len(back)}

    split = {f"{end}_{key}": value for end in ("first", "last") for key, value in sizes(ends[end]).items()}
    return LayerCost(forward_s=est.forward_s, backward_s=est.backward_s, comm_s=comm,
                     forward_comm_s=est.forward_comm_s, attention_core_s=core_s,
                     param_bytes=param_bytes, param_tensors=len(params), expert_param_bytes=expert_bytes,
                     activation_bytes=activations,
                     attention_core_bytes=core_bytes, input_bytes=act_in, flops=est.flops_per_step,
                     ep_sync_s=est.grad_sync_s,
                     backward_param_bytes=sum(value_spec(graph, name).local_nbytes(0) for name in read_back),
                     backward_param_tensors=len(read_back), **split)


def _end_parameters(graph: Graph, params: list[str]) -> dict[str, list[str]]:
    """The parameters outside the numbered layers read only before them (``first``: the embedding, the position
    embedding) and only after them (``last``: the final norm, an untied head), as the pipeline cuts them onto its
    first and last stage; a parameter read on both sides (a tied embedding) is in neither.  A parameter's readers
    are followed through the redistributions made for them."""
    order = {node.name: i for i, node in enumerate(graph.topo_order())}

    def readers(value: str) -> list[int]:
        found = []
        for consumer, _ in graph.consumers(value):
            if _is_backward(consumer):
                continue
            if consumer.op == "redistribute":
                found += [i for out in consumer.outputs for i in readers(out)]
            else:
                found.append(order[consumer.name])
        return found

    inside = [i for name in params if _LAYER_NUMBER.match(name) for i in readers(name)]
    ends: dict[str, list[str]] = {"first": [], "last": []}
    if not inside:
        return ends
    start, stop = min(inside), max(inside)
    for name in params:
        if _LAYER_NUMBER.match(name):
            continue
        at = readers(name)
        before, after = any(i < start for i in at), any(i > stop for i in at)
        if before != after:
            ends["first" if before else "last"].append(name)
    return ends


def _backward_read(graph: Graph, params: list[str]) -> list[str]:
    """The parameters a node of the gradient graph reads (directly or through a redistribute made for it): those
    ZeRO-3 gathers a second time, for the backward (passes/zero.py ``regather``); a linear layer's bias is not
    among them (its gradient is the output's gradient summed)."""
    from layout_prop.passes.zero import _is_backward as runs_in_backward

    return [name for name in params if any(runs_in_backward(graph, consumer) for consumer, _ in
                                           graph.consumers(name))]


def _is_backward(node) -> bool:
    from layout_prop.core import meta

    return node.meta.get(meta.INSERTED_BY) == "backward" or node.name.startswith("grad/")


def _saved_bytes(graph: Graph) -> int:
    """Bytes on rank 0 of the forward values the backward reads: the activations a micro-batch keeps until its
    backward (an op output, or an input without a gradient, read by a node of the gradient graph)."""
    from layout_prop.passes.propagate import value_spec

    total = 0
    for node in graph.topo_order():
        if _is_backward(node) or (node.is_input and node.attrs.get("requires_grad")):
            continue
        for value in node.outputs:
            if any(_is_backward(consumer) for consumer, _ in graph.consumers(value)):
                spec = value_spec(graph, value)
                total += spec.local_nbytes(0) if spec is not None else 0
    return total


def boundary_readers(graph: Graph) -> int:
    """How many forward ops of a graph's last numbered layer read a value of the layer before (an op counted once
    a value): a pre-norm block's input is read by its norm and its residual add, two gradient terms.  The
    pipelined program sums them on the stage that makes them and sends one message (passes/pipeline.py
    assign_positions), so :func:`evaluate` no longer multiplies the move back by this count.  1 when the graph
    has no numbered layers."""
    numbers = {}
    for node in graph.nodes:
        if node.is_input or _is_backward(node):
            continue
        found = _LAYER_NUMBER.match(node.name)
        if found:
            numbers[node.name] = int(found.group(2))
    if not numbers:
        return 1
    last = max(numbers.values())
    pairs = set()
    for node in graph.nodes:
        if numbers.get(node.name) != last:
            continue
        for value in node.inputs:
            if graph.has_value(value) and numbers.get(graph.producer(value)[0].name) == last - 1:
                pairs.add((node.name, value))
    return max(len(pairs), 1)


def boundary_bytes(model: ModelShape, tp: int, cp: int, micro_batch: int) -> int:
    """A layer's input (micro-batch, seq, hidden) on one rank: what a stage sends the next, and what full
    recomputation keeps of a layer (Megatron's sequence parallelism splits it on tp too; Korthikanti et al.
    section 5: ``2 s b h`` bytes in 16 bits).

    >>> boundary_bytes(ModelShape("gpt", 1, 12288, 96, 49152, 2048, "float16"), 8, 1, 1)  # 2 s b h
    50331648
    """
    seq_split = cp * (tp if model.sequence_parallel else 1)
    return micro_batch * model.seq * model.hidden * model.itemsize // seq_split


def stage_mixes(layers: int, dense: int, pp: int) -> list[tuple[int, int]]:
    """The distinct (main layers, dense layers) a stage holds, ``ceil(layers / pp)`` consecutive layers a stage,
    the ``dense`` first layers dense.

    >>> stage_mixes(61, 3, 16)  # DeepSeek-V3 on 16 stages: 4, 4, ... and 1 on the last
    [(1, 3), (4, 0), (1, 0)]
    """
    per_stage = par.ceil_div(layers, pp)
    mixes = []
    for first in range(0, layers, per_stage):
        last = min(first + per_stage, layers)
        n_dense = max(0, min(last, dense) - first)
        mix = (last - first - n_dense, n_dense)
        if mix not in mixes:
            mixes.append(mix)
    return mixes


def stage_positions(layers: int, dense: int, pp: int) -> list[tuple[int, int, bool, bool]]:
    """The distinct (main layers, dense layers, first, last) of the stages, as :func:`stage_mixes` with whether the
    stage is the first (it holds the embedding) and the last (the final norm and the head).

    >>> stage_positions(4, 0, 2), stage_positions(4, 0, 1)
    ([(2, 0, True, False), (2, 0, False, True)], [(4, 0, True, True)])
    >>> stage_positions(61, 3, 16)
    [(1, 3, True, False), (4, 0, False, False), (1, 0, False, True)]
    """
    per_stage = par.ceil_div(layers, pp)
    found = []
    for s, first in enumerate(range(0, layers, per_stage)):
        last = min(first + per_stage, layers)
        n_dense = max(0, min(last, dense) - first)
        key = (last - first - n_dense, n_dense, s == 0, last == layers)
        if key not in found:
            found.append(key)
    return found


def _rest_on_stage(rest: LayerCost, field_: str, first: bool, last: bool) -> float:
    """``rest``'s parameter figure ``field_`` (param_bytes, param_tensors, backward_param_bytes or
    backward_param_tensors) held by a stage: the first stage's own, the last stage's own, and the shared ones (a
    tied embedding) on both; a middle stage holds none."""
    own_first, own_last = getattr(rest, "first_" + field_), getattr(rest, "last_" + field_)
    shared = getattr(rest, field_) - own_first - own_last
    return (own_first if first else 0) + (own_last if last else 0) + (shared if first or last else 0)


def _stage(c: Config, layer: LayerCost, dense: LayerCost | None, rest: LayerCost, n_main: int,
           n_dense: int, first: bool = True, last: bool = True) -> dict[str, float]:
    """One micro-batch through a stage of ``n_main`` main and ``n_dense`` dense layers.  The embedding's and head's
    time is counted on every stage (on the first and last stage in the program: an overestimate of at most the
    smaller of the two); their parameters on the stage that holds them (``first``, ``last``: the embedding on the
    first, the final norm and head on the last, a tied embedding on both), for the gradient synchronisation, the
    optimizer and the model states."""
    kinds = [(layer, n_main)] + ([(dense, n_dense)] if dense is not None and n_dense else [])
    held = ("param_bytes", "param_tensors", "backward_param_bytes", "backward_param_tensors")

    def total(field_: str) -> float:
        own = _rest_on_stage(rest, field_, first, last) if field_ in held else getattr(rest, field_)
        return sum(n * getattr(k, field_) for k, n in kinds) + own

    # the parameters ZeRO-3 gathers again for the backward: those the gradient reads, and with full recomputation
    # every layer's (the recomputed forward reads them all; the embedding and head are not recomputed)
    read_back = (total("backward_param_bytes"), total("backward_param_tensors"))
    if c.recompute == "full":
        recompute = sum(n * (k.forward_s + k.forward_comm_s) for k, n in kinds)
        kept = sum(n * k.input_bytes for k, n in kinds)
        read_back = (sum(n * k.param_bytes for k, n in kinds) + total("backward_param_bytes")
                     - sum(n * k.backward_param_bytes for k, n in kinds),
                     sum(n * k.param_tensors for k, n in kinds) + total("backward_param_tensors")
                     - sum(n * k.backward_param_tensors for k, n in kinds))
    elif c.recompute == "selective":
        recompute = sum(n * k.attention_core_s for k, n in kinds)
        kept = sum(n * max(k.activation_bytes - k.attention_core_bytes, 0) for k, n in kinds)
    else:
        recompute = 0.0
        kept = sum(n * k.activation_bytes for k, n in kinds)
    return {"fwd": total("forward_s"), "bwd": total("backward_s"), "comm": total("comm_s"), "recompute": recompute,
            "fcomm": total("forward_comm_s"),
            "params": total("param_bytes"), "tensors": max(total("param_tensors"), 1),
            "read_back": read_back,
            "ep_sync": sum(n * k.ep_sync_s for k, n in kinds), "kept": kept,
            "working": max(k.activation_bytes for k, n in kinds if n) if n_main + n_dense else 0}


def evaluate(config: Config, model: ModelShape, cluster: Cluster, global_batch: int, cache: LayerCache,
             order: tuple[str, ...] = DEFAULT_ORDER) -> Candidate:
    """The predicted step time and memory per rank of one configuration (module docstring, step 3)."""
    c = config
    layer, rest, dense = cache.get(c.tp, c.cp, c.ep, c.micro_batch)
    data = c.dp * c.ep
    m = global_batch // (c.micro_batch * data)
    shape = tuple(c.degree(a) for a in order)
    move_f = move_b = 0.0
    if c.pp > 1:  # a stage sends its output as the pipelined program does (passes/pipeline.py): the residual stream
        # as it is on a rank (without sequence parallelism whole on every tp rank; Megatron-LM's scatter/gather,
        # Narayanan et al. SC'21 section 4.1, would send 1/t of it), priced on the slowest link the pp axis spans,
        # as estimate prices the program's moves (a one-link permute on the axis); the gradient comes back as one
        # message of the same size (the program sums the input's gradient terms before it sends them)
        sent = layer.input_bytes
        spans_nodes = axis_span(shape, order.index("pp"), cluster.devices_per_node)[1] > 1
        move_f = par.p2p_time(sent, cluster, spans_nodes)
        move_b = move_f
    stages = [_stage(c, layer, dense, rest, n_main, n_dense, first, last) for n_main, n_dense, first, last
              in stage_positions(model.layers, model.dense_layers if dense is not None else 0, c.pp)]
    # the pipeline runs at its busiest stage's pace
    busy = max(stages, key=lambda st: st["fwd"] + st["bwd"] + st["comm"] + st["recompute"])
    fwd, bwd, comm, recompute = busy["fwd"], busy["bwd"], busy["comm"], busy["recompute"]
    # the schedule's makespan with the moves on its dependencies (perf/parallel.py pipeline_makespan: exact for
    # GPipe and 1F1B against passes/schedule.py simulate on uniform stages); a forward chunk carries the forward's
    # collectives, a backward chunk the backward's and the recomputation
    forward_comm = min(max(busy["fcomm"], 0.0), comm)
    t_f = fwd + forward_comm
    t_b = bwd + comm - forward_comm + recompute
    tied = 0.0
    if c.pp == 2 and model.tie:  # the pipelined program sends the head's gradient of a tied embedding (vocab-sharded
        # on tp), summed over the micro-batches, to the first stage once a step, before its last backward (passes/
        # pipeline.py summed_once); with two stages on the link that task's input gradient comes by, as estimate
        # times it (with more stages it comes from another stage than the one the task follows: not on the path)
        tied = par.p2p_time(model.vocab * model.hidden * model.itemsize / c.tp, cluster, spans_nodes)
    pipe = par.pipeline_makespan(t_f, t_b, c.pp, m, c.schedule, c.v, move_f, move_b, move_last=tied)
    still = par.pipeline_makespan(t_f, t_b, c.pp, m, c.schedule, c.v)
    p2p_exposed = pipe - still
    bubble = still - m * (t_f + t_b)
    dp_axis = order.index("dp")
    inflight = par.inflight_microbatches(c.pp, m, c.schedule, c.v) if c.pp > 1 else 1
    shard = c.dp if c.zero >= 1 else 1
    exposed = sync = optimizer = memory = states = activations = 0.0
    for st in stages:  # every stage synchronises its own gradients; the step waits for the slowest
        grads, tensors = st["params"], st["tensors"]
        # one collective a parameter (the step model's pricing: latency counts once per tensor), of the mean size;
        # placed as the step model places them: stages 0 and 1 reduce once a step, overlapped with the last
        # micro-batch's backward, stages 2 and 3 every micro-batch, overlapped with its backward (stage 3: the
        # forward's gathers with the forward, prefetched a layer ahead); stages 1 and 2 gather the updated parameters after the optimizer,
        # exposed; stage 3 gathers every parameter for the forward and, for the backward, those it reads (as the
        # program does; counting every parameter twice put the search 5-13% above estimate)
        reduce_one, gather_one = par.zero_sync_parts(grads / tensors, c.zero, shape, dp_axis, cluster)
        reduce_s, gather_s = tensors * reduce_one, tensors * gather_one
        if not c.overlap_grad_reduce:  # every reduction after the backward (each micro-batch's for stages 2, 3)
            st_sync = (m if c.zero >= 2 else 1) * reduce_s + gather_s * (m if c.zero == 3 else 1) + st["ep_sync"]
            st_exposed = st_sync
        elif c.zero <= 1:
            st_sync = reduce_s + gather_s + st["ep_sync"]
            st_exposed = max(reduce_s + st["ep_sync"] - st["bwd"], reduce_one + layer.ep_sync_s) + gather_s
        elif c.zero == 2:
            st_sync = m * reduce_s + gather_s + st["ep_sync"]
            st_exposed = m * max(reduce_s - st["bwd"], reduce_one) + gather_s + st["ep_sync"]
        else:
            first, gather_s = par.zero3_gather_time((grads, tensors), st["read_back"], shape, dp_axis, cluster)
            forward_gathers = par.zero3_gather_time((grads, tensors), (0.0, 0), shape, dp_axis, cluster)[1]
            per_mb = reduce_s + gather_s
            st_sync = m * per_mb + st["ep_sync"]
            # (each phase's traffic hidden by that phase's compute, prefetched a layer ahead, as the step model
            # hides it: perf/parallel.py zero3_exposed)
            st_exposed = m * par.zero3_exposed(forward_gathers, gather_s - forward_gathers + reduce_s, st["fwd"],
                                               st["bwd"] + st["recompute"], first, reduce_one) + st["ep_sync"]
        st_optimizer = par.optimizer_time(grads / shard, model.itemsize, cluster)
        if st_exposed + st_optimizer >= exposed + optimizer:
            exposed, sync, optimizer = st_exposed, st_sync, st_optimizer
        # memory per rank: model states (ZeRO over dp) and the activations the schedule keeps in flight (the
        # first stage's count for every stage: an overestimate for the later ones); the head's kept for one
        st_states = par.zero_model_state_bytes(grads / model.itemsize, c.zero, c.dp, model.itemsize)
        st_activations = inflight * st["kept"] + max(rest.activation_bytes, 0)
        if c.recompute == "full":
            st_activations += st["working"]  # the layer being recomputed holds its activations
        if st_states + st_activations > memory:
            memory, states, activations = st_states + st_activations, st_states, st_activations
    # the weight gradients summed over the micro-batches (perf/parallel.py accumulation_time: m - 1 adds of a
    # stage's gradients, with ZeRO 2 and 3 of the reduce-scattered shard), the longest stage's, after the schedule
    # as estimate of a pipelined spec adds it (without a pipeline estimate counts it in the backward: the same sum)
    accumulate = max(par.accumulation_time(st["params"] / (c.dp if c.zero >= 2 else 1), m, cluster) for st in stages)
    step = pipe + accumulate + exposed + optimizer
    n_dense = model.dense_layers if dense is not None else 0
    layer_flops = (model.layers - n_dense) * layer.flops + (n_dense * dense.flops if n_dense else 0)
    flops = (layer_flops + rest.flops) * m * c.dp
    tflops = flops / step / c.devices / 1e12 if step > 0 else 0.0
    peak = cluster.peak_flops(model.dtype)
    parts = {"compute_s": m * (fwd + bwd), "recompute_s": m * recompute, "comm_s": m * comm, "p2p_s": p2p_exposed,
             "bubble_s": bubble, "accumulate_s": accumulate,
             "grad_sync_s": sync, "grad_sync_exposed_s": exposed, "optimizer_s": optimizer,
             "micro_batches": m, "layers_per_stage": par.ceil_div(model.layers, c.pp), "model_states_bytes": states,
             "activation_bytes": activations}
    return Candidate(config=c, step_time_s=step, memory_bytes=memory, tflops_per_device=tflops,
                     mfu=tflops * 1e12 / peak if peak else 0.0, parts=parts)


def search(model: ModelShape, cluster: Cluster, devices: int, global_batch: int, analyse: Callable[[dict], Graph],
           memory_limit: int | None = None, fixed: dict[str, int] | None = None,
           order: tuple[str, ...] = DEFAULT_ORDER, progress=None, keep_all: bool = False) -> SearchResult:
    """Enumerate, price and rank every configuration (module docstring); raise :class:`InfeasibleSearch` when
    none fits ``memory_limit`` (default: the device's memory).  ``analyse``: see :class:`LayerCache`."""
    start = time.perf_counter()
    if not 1 <= devices <= MAX_DEVICES:
        raise SpecError("bad-devices", f"--devices is {cut(devices, 40)}, not a count in 1..{MAX_DEVICES:,}",
                        hint="give --devices 8 or more, at most 2^24 (the largest clusters have about 10^5)")
    if global_batch < 1:
        raise SpecError("bad-batch", f"--global-batch is {global_batch}, not a positive count",
                        hint="give the sequences a step trains, like --global-batch 512")
    if cluster.nodes is not None and devices > cluster.nodes * cluster.devices_per_node:
        raise SpecError("mesh-too-large", f"{devices:,} devices, cluster {cluster.name!r} has "
                        f"{cluster.nodes * cluster.devices_per_node:,}", hint="use fewer devices or a larger cluster")
    limit = cluster.hbm_bytes if memory_limit is None else memory_limit
    configs = enumerate_configs(model, devices, global_batch, cluster, fixed)
    cache = LayerCache(model, cluster, analyse)
    keys = sorted({(c.tp, c.cp, c.ep, c.micro_batch) for c in configs})
    for i, key in enumerate(keys):
        cache.get(*key)
        if progress is not None:
            progress.update(i + 1)
    ranked, least = [], None
    every = []
    if all(layer.attention_core_bytes == 0 and layer.attention_core_s == 0 for layer, _, _ in cache.costs.values()):
        configs = [c for c in configs if c.recompute != "selective"]  # no (seq x seq) value: the same as none
    for config in configs:
        cand = evaluate(config, model, cluster, global_batch, cache, order)
        if keep_all:
            every.append(cand)
        if least is None or cand.memory_bytes < least.memory_bytes:
            least = cand
        if cand.memory_bytes <= limit:
            ranked.append(cand)
    if not ranked:
        raise InfeasibleSearch(f"no configuration fits {limit:,} bytes per rank; the least memory found is "
                               f"{int(least.memory_bytes):,} bytes with {least.config.label()}",
                               least.memory_bytes, least.config, limit)
    ranked.sort(key=lambda c: (c.step_time_s, c.memory_bytes))
    result = SearchResult(model=model, cluster=cluster.name, devices=devices, global_batch=global_batch,
                          memory_limit=limit, ranked=ranked, candidates=len(configs),
                          layer_evaluations=cache.evaluations,
                          seconds=time.perf_counter() - start, least_memory=least)
    if model.imported is not None:  # one line: what the generator's graph the import is priced with leaves out
        result.notes.append(model.imported.note(model.family))
    if keep_all:
        result.notes.append("all")
        result.every = every  # type: ignore[attr-defined]
    if model.family == "moe" and model.capacity_factor is None:
        result.notes.append("the spec drops no token (no capacity factor): every expert's buffer holds every token, "
                            "as the generator's exact routing does; gen moe --capacity-factor 1 prices balanced "
                            "routing")
    if model.distinct_layers > 1 and not model.dense_layers:
        result.notes.append(f"{model.distinct_layers} distinct layer shapes recognised; every layer is priced as "
                            "the first (the generators write one layer shape)")
    return result
