"""What ``layout-prop export`` hands to another framework: the checked layouts of a graph, by the model's own names.

:func:`collect` analyses a graph (a spec, an imported model, or ``plan``'s output) and returns an
:class:`ExportPlan`: the mesh, each graph input's layout as layout-prop resolved it (``auto``
completed), split into the model's *inputs* (data the training script passes in) and its
*parameters* (weights and constants), the layouts layout-prop predicts for the graph's outputs and,
for the MindSpore target, the layouts every op node receives after ``check --reshard``.

The same plan is written as data (:func:`plan_data`, :func:`format_data`): a sharding-plan file
(``mesh``, ``inputs``, ``parameters``, the format ``import --plan`` reads, every name exact: glob
characters escaped) whose layouts are in layout-prop's own dims of each tensor, so that importing
the model again with it, or writing its placements back into the spec, gives the same layouts.

A parameter of an ONNX model that torch's exporter stored transposed (a ``Linear`` weight folded into
a ``MatMul`` as ``(in, out)``, under a name of its own) is exported to torch and hyper-parallel in the module's own dims
(``(out, in)``): :attr:`ExportTensor.transposed` says so, and :meth:`ExportTensor.own_layout` swaps
the two dims of its shards.

Examples
--------
>>> from layout_prop.io.loader import load_spec
>>> g = load_spec('''
... mesh: {shape: [2], names: [tp]}
... inputs:
...   x: {shape: [4, 8]}
...   w: {shape: [8, 6], placements: ["S(1)"]}
... nodes:
...   - {name: y, op: matmul, inputs: [x, w]}
... outputs: [y]
... ''')
>>> from layout_prop.api import analyze
>>> plan = collect(g, analyze(g, reshard=True).graph, data_inputs=["x"])
>>> sorted(plan.parameters), sorted(plan.inputs), plan.outputs["y"].placement_strs()
(['w'], ['x'], ['S(1)'])
>>> print(format_data(plan, "yaml"), end="")
# layout-prop export: 1 input(s), 1 parameter(s); layout-prop predicts the outputs: y: [S(1)]
mesh: {shape: [2], names: [tp]}
inputs:
  x: {placements: [R]}
parameters:
  w: [S(1)]
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from layout_prop.core import meta
from layout_prop.core.errors import LayoutError, SpecError
from layout_prop.core.graph import Graph
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import DeviceMesh
from layout_prop.core.placement import Partial, Replicate, Shard, StridedShard

__all__ = ["ExportTensor", "ExportNode", "ExportPlan", "TrainingConfig", "collect", "plan_data", "format_data",
           "not_expressible", "not_written", "own_parameters", "tied_copy", "unmarked_inputs_note", "drop_unit_axes",
           "TARGETS", "INTEGER_DTYPES"]

#: the frameworks ``export --to`` writes for
TARGETS = ("hyper-parallel", "mindspore", "torch")
#: ops whose operand 1 is a module's weight (``M.weight``: the node is module ``M``'s forward)
WEIGHT_OPS = ("linear", "matmul", "embedding", "batch_matmul")
#: dtypes that take no gradient: an input of one is data (token ids, labels), never a parameter
INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "bool")


def not_expressible(target: str, what: str, name: str, layout: Layout, why: str, hint: str) -> LayoutError:
    """The one-line error for a layout ``target`` cannot state (``not-expressible``), naming the tensor and layout."""
    return LayoutError("not-expressible", f"{target} cannot express the layout {layout.placement_strs()} of "
                       f"{what} {name!r}: {why}", hint=hint)


def not_written(target: str, what: str, why: str, hint: str) -> LayoutError:
    """The one-line error for a piece of the training configuration ``target``'s export does not write
    (``not-expressible``): never a silent drop of a spec's ``zero:``, ``recompute:`` or ``pipeline:`` block."""
    return LayoutError("not-expressible", f"the {target} export cannot write {what}: {why}", hint=hint)


@dataclass(frozen=True)
class TrainingConfig:
    """The spec's training configuration beside its layouts: ZeRO, recomputation, pipeline, the step's batch.

    Read from the spec's ``zero:``, ``recompute:``, ``pipeline:`` and ``training:`` blocks (each
    checked as ``check`` reads it); ``None`` / ``"none"`` / empty where the spec has no such block.
    """

    zero_stage: int = 0
    zero_axes: tuple[str, ...] = ()
    recompute: str = "none"
    recompute_layers: tuple[str, ...] | None = None
    pipeline_axis: str | None = None
    pipeline_stages: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    micro_batches: int = 1
    pipeline_loss: str = "mean"  # the batch loss over a pipeline's micro-batches: their mean or sum
    global_batch: int | None = None
    micro_batch: int | None = None

    @property
    def any(self) -> bool:
        return bool(self.zero_stage) or self.recompute != "none" or self.pipeline_axis is not None \
            or self.global_batch is not None

    @classmethod
    def of(cls, graph: Graph) -> "TrainingConfig":
        """The configuration of ``graph``'s blocks (``graph.meta``), each parsed as ``check`` parses it."""
        from layout_prop.passes.pipeline import PipelineConfig
        from layout_prop.passes.recompute import parse_recompute
        from layout_prop.passes.zero import parse_zero

        out: dict = {}
        if graph.meta.get(meta.ZERO) is not None:
            zero = parse_zero(graph.meta[meta.ZERO], graph.mesh)
            out.update(zero_stage=zero.stage, zero_axes=tuple(zero.axes) if zero.stage else ())
        if graph.meta.get(meta.RECOMPUTE) is not None:
            out["recompute"], out["recompute_layers"] = parse_recompute(graph.meta[meta.RECOMPUTE])
        if graph.meta.get(meta.PIPELINE) is not None:
            p = PipelineConfig.from_spec(graph.meta[meta.PIPELINE], graph.mesh)
            out.update(pipeline_axis=p.axis, pipeline_stages=p.stages, schedule=p.schedule,
                       virtual_stages=p.virtual_stages, micro_batches=p.micro_batches, pipeline_loss=p.loss)
        if graph.meta.get(meta.TRAINING) is not None:  # checked as estimate checks it: nan, '4', -4, 0 are bad-value
            from layout_prop.io.spec_blocks import parse_training

            training = parse_training(graph.meta[meta.TRAINING])
            out.update(global_batch=training.global_batch, micro_batch=training.micro_batch)
        return cls(**out)


@dataclass(frozen=True)
class ExportTensor:
    """One graph input: its name, the model's own name for it, shape, dtype and resolved layout.

    ``transposed`` is true for a 2-D weight that the model holds as the transpose of the
    graph's tensor (torch's ``Linear`` weight, ``(out, in)``, read by an ONNX ``MatMul`` as ``(in, out)``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout
    kind: str  # "input" (data), "parameter", "buffer" (a spec's input without gradient) or "constant"
    transposed: bool = False
    consumers: tuple[str, ...] = ()  # the ops reading it (embedding, matmul, linear...)
    #: held as a torch ``Linear`` weight, ``(out, in)``, in the model's own dims: read only as the weight
    #: of ``linear`` or of a ``matmul`` that transposes it, or stored transposed by the ONNX exporter
    linear_weight: bool = False
    #: the model's other names for this tensor (parameters the ONNX exporter de-duplicated into one)
    aliases: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        """This tensor's name and its aliases: every model parameter it stands for."""
        return (self.name, *self.aliases)

    def own_layout(self) -> Layout:
        """The layout in the model's own dims (the two dims swapped for a ``transposed`` weight)."""
        if not self.transposed:
            return self.layout
        swapped = []
        for p in self.layout.placements:
            if isinstance(p, Shard):
                p = Shard(1 - p.dim)
            elif isinstance(p, StridedShard):
                p = StridedShard(1 - p.dim, p.split_factor)
            swapped.append(p)
        return Layout(self.layout.mesh, swapped, self.layout.ndim)

    @property
    def own_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transposed else self.shape


@dataclass(frozen=True)
class ExportNode:
    """An op node of the resharded graph: the layouts it receives and makes (MindSpore's strategies)."""

    name: str
    op: str
    inputs: tuple[str, ...]
    in_layouts: tuple[Layout | None, ...]
    out_layouts: tuple[Layout | None, ...]


def tied_copy(plan: "ExportPlan", tensor: ExportTensor) -> ExportTensor | None:
    """The parameter ``tensor`` copies, for a transposed copy the importer named ``NAME.T`` (GPT-2's tied
    ``lm_head``), else None.  A spec's own ``NAME.T`` is a parameter of its own (only the importer names copies)."""
    if not plan.model or not tensor.name.endswith(".T") or len(tensor.shape) != 2:
        return None
    return plan.parameters.get(tensor.name[:-2])


def own_parameters(plan: "ExportPlan", target: str) -> list[tuple[str, ExportTensor]]:
    """``(model parameter name, tensor)`` for every parameter the model has: aliases included, constants
    and tied copies left out (a copy whose layout, transposed back, differs from its parameter's is
    ``not-expressible``: one parameter takes one layout)."""
    out = []
    for tensor in plan.parameters.values():
        if tensor.kind != "parameter":
            continue
        original = tied_copy(plan, tensor)
        if original is not None:
            back = ExportTensor(tensor.name, tensor.shape, tensor.dtype, tensor.layout, tensor.kind, True).own_layout()
            if back != original.layout:
                raise not_expressible(target, "parameter", tensor.name, tensor.layout, f"it is {original.name!r} "
                                      f"(tied, read transposed), whose layout is {original.layout.placement_strs()}",
                                      "give the tied weight and its copy the same layout (transposed)")
            continue
        out.extend((name, tensor) for name in tensor.names())
    return out


@dataclass(frozen=True)
class ExportChunk:
    """One model chunk of a pipelined plan: chunk ``index`` runs on pipeline stage ``stage`` (``index % stages``).

    ``layers`` are the decoder layers whose nodes (``l<i>_...``) it runs; ``reads`` the graph inputs its
    forward nodes read (parameters, buffers, model inputs), in graph order; ``receives`` the values made by
    earlier chunks it reads, ``sends`` the values it makes that later chunks read, each with its layout
    (``(name, layout)``); ``first`` and ``last`` are the forward's first and last nodes it runs.
    """

    index: int
    stage: int
    layers: tuple[int, ...]
    reads: tuple[str, ...]
    receives: tuple[tuple[str, Layout], ...]
    sends: tuple[tuple[str, Layout], ...]
    first: str
    last: str


def chunk_values(graph: Graph, done: Graph, chunk_of: dict[str, int], stages: int) -> tuple[ExportChunk, ...]:
    """Each model chunk of a pipelined ``graph`` (``chunk_of``: forward op node -> chunk, as
    :func:`layout_prop.workflows.export.pipeline_chunks` cuts it; ``stages``: the pipeline axis's size): what it reads and the values
    crossing chunks, with their layouts in ``done`` (the graph analysed as ``check --reshard`` does)."""
    from layout_prop.passes.pipeline import LAYER

    made_by = {}
    for node in graph.topo_order():
        if node.name in chunk_of:
            for value in node.outputs:
                made_by[value] = chunk_of[node.name]
    chunks = []
    for index in range(max(chunk_of.values(), default=-1) + 1):
        nodes = [n for n in graph.topo_order() if chunk_of.get(n.name) == index]
        reads, receives = [], []
        for node in nodes:
            for value in node.inputs:
                producer = graph.producer(value)[0]
                if producer.is_input and value not in reads:
                    reads.append(value)
                elif made_by.get(value, index) < index and value not in receives:
                    receives.append(value)
        sends = [v for n in nodes for v in n.outputs
                 if any(chunk_of.get(c.name, index) > index for c, _ in graph.consumers(v))]
        layers = sorted({int(m.group(1)) for m in (LAYER.match(n.name) for n in nodes) if m})

        def with_layout(values):
            return tuple((v, _value_spec(done, v).layout) for v in values)

        chunks.append(ExportChunk(index, index % stages, tuple(layers), tuple(reads), with_layout(receives),
                                  with_layout(sends), nodes[0].name if nodes else "", nodes[-1].name if nodes else ""))
    return tuple(chunks)


@dataclass
class ExportPlan:
    """The checked layouts of one graph, ready to be written for a target (see the module docstring)."""

    mesh: DeviceMesh
    source: str
    inputs: dict[str, ExportTensor] = field(default_factory=dict)
    parameters: dict[str, ExportTensor] = field(default_factory=dict)
    outputs: dict[str, Layout] = field(default_factory=dict)
    nodes: list[ExportNode] = field(default_factory=list)
    #: every redistribution of the resharded graph: (value moved, its layout, the layout it is moved to)
    moves: list[tuple[str, Layout, Layout]] = field(default_factory=list)
    model: bool = False  # imported from a model file (names are the model's own)
    config: TrainingConfig = field(default_factory=TrainingConfig)
    #: the mesh axes of size 1 left out of ``mesh`` (:func:`drop_unit_axes`)
    dropped_axes: tuple[str, ...] = ()
    #: the graph inputs taken as model inputs without ``--input``, with why (:func:`collect`)
    recognised: dict[str, str] = field(default_factory=dict)
    #: each embedding's output value -> its table's name (torch's MaskPartial starts there)
    embeddings: dict[str, str] = field(default_factory=dict)
    #: each op node reading a graph input as its weight (operand 1 of linear, matmul, embedding...) -> that input
    weights: dict[str, str] = field(default_factory=dict)
    #: each moved value -> the op nodes reading the moved copy
    move_consumers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: a pipelined plan's forward op nodes -> their chunk, as ``layout-prop pipeline SPEC`` cuts them (chunk ``c``
    #: runs on stage ``c % stages``: :func:`layout_prop.workflows.export.pipeline_chunks`); empty without a ``pipeline:`` block
    chunks: dict[str, int] = field(default_factory=dict)
    #: a pipelined plan's model chunks, what each reads and the values crossing them (:func:`chunk_values`)
    chunk_plan: tuple[ExportChunk, ...] = ()
    #: the forward op nodes the spec's ``recompute:`` block recomputes, by layer (``passes.recompute.segments``)
    recomputed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: a pipelined plan's stage: one micro-batch of the graph on the stage mesh (the pipeline axis left out),
    #: analysed as ``check SPEC --reshard`` analyses it (:func:`layout_prop.workflows.export.stage_collect`); None without a ``pipeline:`` block
    stage: "ExportPlan | None" = None

    def tensors(self) -> dict[str, ExportTensor]:
        return {**self.inputs, **self.parameters}


def _value_spec(graph: Graph, value: str):
    node, index = graph.producer(value)
    specs = node.meta.get(meta.SPECS) or ()
    return specs[index] if index < len(specs) else None


def _stored_transposed(graph: Graph, name: str, shape: tuple[int, ...]) -> bool:
    """Whether an imported parameter is a torch ``Linear`` weight the ONNX exporter folded as ``(in, out)``.

    That is a 2-D ``*.weight`` the file holds under another name (torch's dynamo exporter folds
    ``Linear``'s transpose into a new initializer, ``val_105``, named back from its metadata) and that
    is read only as the right operand of an untransposed ``matmul``.  A weight the file holds under
    its own name is the module's own tensor (GPT-2's ``Conv1D``, already ``(in, out)``).
    """
    sources = graph.meta.get(meta.IMPORT_SOURCES) or {}
    if len(shape) != 2 or not name.endswith(".weight") or sources.get(name, name) == name:
        return False
    uses = graph.consumers(name)
    return bool(uses) and all(node.op == "matmul" and index == 1 and not node.attrs.get("transpose_b")
                              for node, index in uses)


def _read_as_linear(graph: Graph, name: str, shape: tuple[int, ...]) -> bool:
    """Whether a 2-D input is read only as an ``(out, in)`` weight: ``linear``'s, or a transposing ``matmul``'s."""
    uses = graph.consumers(name)
    return len(shape) == 2 and bool(uses) and all(
        index == 1 and (node.op == "linear" or (node.op == "matmul" and node.attrs.get("transpose_b")))
        for node, index in uses)


def _input_reason(spec, requires_grad: bool, guess: bool) -> str | None:
    """Why a spec's graph input is a model input although ``--input`` did not name it, or None.

    An integer tensor takes no gradient: it is data (token ids, labels), whatever ``--input`` says.
    Without ``--input`` (``guess``), a float tensor that takes a gradient and whose dim 0 is cut on a
    data-parallel mesh axis (dp, data, fsdp) is a batch of activations: parameters are replicated on
    those axes in a spec (ZeRO shards them by its block, not by their placements).
    """
    from layout_prop.passes.zero import DATA_AXES

    if spec.dtype in INTEGER_DTYPES:
        return "integer: data"
    if not guess or not requires_grad:
        return None
    for name, p in zip(spec.layout.mesh.names, spec.layout.placements):
        if name in DATA_AXES and isinstance(p, Shard) and p.dim == 0 and spec.layout.mesh.shape[
                spec.layout.mesh.axis_index(name)] > 1:
            return f"dim 0 cut on {name}: a batch"
    return None


def collect(graph: Graph, done: Graph, *, data_inputs: Iterable[str] | None = None, source: str = "",
            nodes: bool = False, aliases: dict[str, Sequence[str]] | None = None,
            chunks: dict[str, int] | None = None, stage: "ExportPlan | None" = None) -> ExportPlan:
    """Gather what an export writes from ``graph`` and ``done``, the graph analysed as ``check --reshard``
    does (``layout_prop.api.analyze(graph, reshard=True).graph``).

    ``data_inputs`` names the graph inputs that are the model's inputs (passed in by the
    training script); ``None`` takes them from an imported model (every graph input that is no
    weight of the file: ``graph.meta["import_sources"]``), and for a spec means none. An unknown
    name is ``unknown-input``.  ``nodes`` also gathers every op node's received layouts (a plan with a
    ``pipeline:`` block gathers them always: the values crossing its stages are read from them).

    A plan with a ``pipeline:`` block needs ``chunks`` (the chunk of every forward op node) and ``stage`` (one
    micro-batch collected on the stage mesh): both come from running the pipeline's passes, a driver's work
    above this room, so :func:`layout_prop.workflows.export.collect_plan` computes them and calls this.
    """
    sources = graph.meta.get(meta.IMPORT_SOURCES)
    model = sources is not None
    names = [n.name for n in graph.inputs()]
    if data_inputs is None:
        data = [n for n in names if model and n not in sources]
    else:
        data = list(data_inputs)
        for name in data:
            if name not in names:
                raise SpecError("unknown-input", f"{name!r} is not a graph input", path="--input",
                                hint=f"graph inputs: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
    plan = ExportPlan(mesh=graph.mesh, source=source, model=model, config=TrainingConfig.of(graph))
    for node in done.inputs():
        if node.name.startswith("cotangent/"):
            continue
        spec = node.meta[meta.SPECS][0]
        requires_grad = node.attrs.get("requires_grad", True)
        why = None if model or node.name in data else _input_reason(spec, requires_grad, data_inputs is None)
        if why is not None:
            plan.recognised[node.name] = why
        if node.name in data or why is not None:
            kind = "input"
        elif requires_grad:
            kind = "parameter"
        else:  # takes no gradient: a model's folded constant, a spec's buffer (rotary tables, masks)
            kind = "constant" if model else "buffer"
        transposed = model and kind == "parameter" and _stored_transposed(graph, node.name, tuple(spec.shape))
        consumers = tuple(sorted({n.op for n, _ in graph.consumers(node.name)}))
        linear = transposed or _read_as_linear(graph, node.name, tuple(spec.shape))
        tensor = ExportTensor(node.name, tuple(spec.shape), spec.dtype, spec.layout, kind, transposed, consumers,
                              linear, tuple((aliases or {}).get(node.name, ())))
        (plan.inputs if kind == "input" else plan.parameters)[node.name] = tensor
    for value in done.outputs:
        spec = _value_spec(done, value)
        if spec is not None:
            plan.outputs[value] = spec.layout
    for node in graph.topo_order():
        if node.op == "embedding" and len(node.inputs) > 1:
            plan.embeddings[node.name] = node.inputs[1]
        if node.op in WEIGHT_OPS and len(node.inputs) > 1 and graph.producer(node.inputs[1])[0].is_input:
            plan.weights[node.name] = node.inputs[1]
    for node in done.topo_order():
        if node.op == "redistribute" and node.inputs:
            src, dst = _value_spec(done, node.inputs[0]), (node.meta.get(meta.SPECS) or (None,))[0]
            if src is not None and dst is not None:
                plan.moves.append((node.inputs[0], src.layout, dst.layout))
                readers = tuple(n.name for n, _ in done.consumers(node.name) if n.op != "redistribute")
                plan.move_consumers[node.inputs[0]] = plan.move_consumers.get(node.inputs[0], ()) + readers
    if plan.config.pipeline_axis is not None:
        if chunks is None:
            raise ValueError("a pipelined plan is collected with its chunks: call "
                             "layout_prop.workflows.export.collect_plan, which cuts them and collects the stage")
        plan.chunks, plan.stage = dict(chunks), stage
        plan.chunk_plan = chunk_values(graph, done, plan.chunks, plan.config.pipeline_stages)
    if plan.config.recompute != "none":
        from layout_prop.passes.recompute import segments

        chosen = segments(done, plan.config.recompute, plan.config.recompute_layers)
        plan.recomputed = {layer: tuple(n.name for n in seg if not n.meta.get(meta.INSERTED_BY))
                           for layer, seg in chosen.items()}
    if nodes or plan.config.pipeline_axis is not None:  # a pipeline's stage boundaries are values between nodes
        for node in done.topo_order():
            if node.is_input or node.meta.get(meta.INSERTED_BY):
                continue
            ins = tuple(getattr(_value_spec(done, v), "layout", None) for v in node.inputs)
            outs = tuple(getattr(s, "layout", None) for s in node.meta.get(meta.SPECS) or ())
            plan.nodes.append(ExportNode(node.name, node.op, tuple(node.inputs), ins, outs))
    return plan


def unmarked_inputs_note(plan: ExportPlan, data_inputs: Sequence[str] | None) -> str | None:
    """One note line when ``plan`` told a spec's model inputs from its parameters without ``--input``
    (``data_inputs`` is None), else None: a spec does not say which of its inputs are activations, so the
    guess (:func:`collect`: integer tensors and batches cut on dim 0 by a data-parallel axis are inputs,
    inputs without gradient are buffers, every other input a parameter) is said, never made silently.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> mesh = DeviceMesh((2,), ("tp",))
    >>> tensor = lambda name: ExportTensor(name, (4,), "float32", Layout(mesh, [Replicate()], 1), "parameter")
    >>> plan = ExportPlan(mesh, "mlp.yaml", parameters={n: tensor(n) for n in ("x", "w")})
    >>> print(unmarked_inputs_note(plan, None))  # doctest: +NORMALIZE_WHITESPACE
    note: no --input given: export took as model inputs: none; as parameters (weights to shard): x, w;
    if that is wrong, name every model input (activations, token ids) with --input NAME
    >>> unmarked_inputs_note(plan, ["x"]) is None
    True
    """
    if plan.model or data_inputs is not None or not (plan.parameters or plan.inputs):
        return None  # a model's inputs are its own, and named inputs are the user's word

    def listed(names: list[str]) -> str:
        return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "") or "none"

    inputs = [f"{name} ({why})" for name, why in plan.recognised.items()]
    params = [n for n, t in plan.parameters.items() if t.kind == "parameter"]
    buffers = [n for n, t in plan.parameters.items() if t.kind == "buffer"]
    text = f"note: no --input given: export took as model inputs: {listed(inputs)}; "
    if buffers:
        text += f"as buffers (no gradient): {listed(buffers)}; "
    return text + (f"as parameters (weights to shard): {listed(params)}; if that is wrong, name every model input "
                   "(activations, token ids) with --input NAME")


# --------------------------------------------------------------------------- plan as data
def _flow(items: Sequence[str]) -> str:
    """A YAML flow list; an item holding a comma (``_S(0,3)``) or a space is quoted."""
    return "[" + ", ".join(json.dumps(i) if ("," in i or " " in i) else i for i in items) + "]"


def _key(name: str) -> str:
    """A YAML key for ``name``, quoted when YAML would read it otherwise: punctuation, a word YAML reads
    as no string (``null``, ``true``) and a name starting with no letter (``123``; ``1e3``, which the spec
    loader reads as a float).

    >>> [_key(n) for n in ("fc1.weight", "null", "123", "w[0]")]
    ['fc1.weight', '"null"', '"123"', '"w[0]"']
    """
    import yaml

    plain = name[:1].isalpha() and name.replace(".", "").replace("_", "").replace("/", "").isalnum()
    return name if plain and yaml.safe_load(f"{name}: 0") == {name: 0} else json.dumps(name)  # a digit first: 1e3


def plan_data(plan: ExportPlan) -> dict:
    """The sharding-plan file of ``plan``: ``mesh``, ``inputs`` (placements), ``parameters`` (exact names)."""
    return {
        "mesh": {"shape": list(plan.mesh.shape), "names": list(plan.mesh.names)},
        "inputs": {name: {"placements": t.layout.placement_strs()} for name, t in plan.inputs.items()},
        "parameters": {glob.escape(name): t.layout.placement_strs()  # a constant is no plan's to place
                       for t in plan.parameters.values() if t.kind != "constant" for name in t.names()},
    }


def format_data(plan: ExportPlan, fmt: str) -> str:
    """:func:`plan_data` as YAML (with the predicted outputs in a comment) or JSON text."""
    data = plan_data(plan)
    if fmt == "json":
        return json.dumps(data, indent=1) + "\n"
    outs = "; ".join(f"{name}: {_flow(layout.placement_strs())}" for name, layout in plan.outputs.items())
    lines = [f"# layout-prop export: {len(data['inputs'])} input(s), {len(data['parameters'])} parameter(s); "
             f"layout-prop predicts the outputs: {outs or 'none'}",
             f"mesh: {{shape: {_flow(map(str, plan.mesh.shape))}, names: [{', '.join(map(_key, plan.mesh.names))}]}}"]
    lines.append("inputs:" if data["inputs"] else "inputs: {}")
    for name, entry in data["inputs"].items():
        lines.append(f"  {_key(name)}: {{placements: {_flow(entry['placements'])}}}")
    lines.append("parameters:" if data["parameters"] else "parameters: {}")
    for name, placements in data["parameters"].items():
        lines.append(f"  {_key(name)}: {_flow(placements)}")
    return "\n".join(lines) + "\n"


def placement_args(layout: Layout) -> list[tuple[str, object]]:
    """Each mesh axis's placement as ``(kind, arg)``: ``("R", None)``, ``("S", dim)``, ``("P", op)``, ``("_S", ...)``."""
    out = []
    for p in layout.placements:
        if isinstance(p, Replicate):
            out.append(("R", None))
        elif isinstance(p, Shard):
            out.append(("S", p.dim))
        elif isinstance(p, Partial):
            out.append(("P", p.reduce_op))
        else:
            out.append(("_S", (p.dim, p.split_factor)))
    return out


def drop_unit_axes(plan: ExportPlan) -> ExportPlan:
    """``plan`` on its mesh without the axes of size 1 (:attr:`ExportPlan.dropped_axes` names them).

    A size-1 axis cuts nothing: every placement on it (``S(d)``, ``P``, ``R``) holds the whole tensor.
    A target given one does work for nothing and may stall there (torch's redistribution planner
    searches paths over every mesh axis: on ``dp=2 x sp=1 x tp=2`` it ran 150 s on gen llama's first
    linear). A mesh of size-1 axes only keeps its first axis. A ZeRO or pipeline axis of size 1 is
    dropped from the configuration as well (it shards nothing).

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> mesh = DeviceMesh((2, 1, 2), ("dp", "sp", "tp"))
    >>> w = ExportTensor("w", (4, 4), "float32", Layout(mesh, ["R", "S(0)", "S(1)"], 2), "parameter")
    >>> small = drop_unit_axes(ExportPlan(mesh, "", parameters={"w": w}))
    >>> small.mesh, small.parameters["w"].layout.placement_strs(), small.dropped_axes
    (DeviceMesh(shape=(2, 2), names=('dp', 'tp')), ['R', 'S(1)'], ('sp',))
    """
    import dataclasses

    keep = [i for i, size in enumerate(plan.mesh.shape) if size > 1] or [0]
    if len(keep) == plan.mesh.ndim:
        return plan
    mesh = DeviceMesh(tuple(plan.mesh.shape[i] for i in keep), tuple(plan.mesh.names[i] for i in keep))

    def shrink(layout: Layout | None) -> Layout | None:
        return None if layout is None else Layout(mesh, [layout.placements[i] for i in keep], layout.ndim)

    def tensor(t: ExportTensor) -> ExportTensor:
        return dataclasses.replace(t, layout=shrink(t.layout))

    dropped = tuple(n for i, n in enumerate(plan.mesh.names) if i not in keep)
    config = plan.config
    config = dataclasses.replace(config, zero_axes=tuple(a for a in config.zero_axes if a not in dropped))
    if config.zero_stage and not config.zero_axes:
        config = dataclasses.replace(config, zero_stage=0)
    if config.pipeline_axis in dropped:  # one stage: no pipeline (its micro-batches stay gradient accumulation)
        config = dataclasses.replace(config, pipeline_axis=None, pipeline_stages=1, schedule=None)

    def chunk(c: ExportChunk) -> ExportChunk:
        return dataclasses.replace(c, receives=tuple((v, shrink(a)) for v, a in c.receives),
                                   sends=tuple((v, shrink(a)) for v, a in c.sends))

    return dataclasses.replace(
        plan, mesh=mesh, config=config, dropped_axes=dropped,
        inputs={n: tensor(t) for n, t in plan.inputs.items()},
        parameters={n: tensor(t) for n, t in plan.parameters.items()},
        outputs={n: shrink(layout) for n, layout in plan.outputs.items()},
        nodes=[dataclasses.replace(node, in_layouts=tuple(map(shrink, node.in_layouts)),
                                   out_layouts=tuple(map(shrink, node.out_layouts))) for node in plan.nodes],
        moves=[(v, shrink(a), shrink(b)) for v, a, b in plan.moves],
        chunk_plan=tuple(chunk(c) for c in plan.chunk_plan) if config.pipeline_axis is not None else ())


def refuse_config(plan: ExportPlan, target: str) -> None:
    """Refuse every block of the training configuration (ZeRO, pipeline, recomputation) in one
    ``not-expressible`` line naming the first: for a target whose export writes the layouts only, a plan
    whose ZeRO or pipeline is dropped would be pasted as one that shards nothing (each rank holding every
    weight and optimizer state)."""
    c = plan.config
    blocks = []
    if c.zero_stage:
        blocks.append(f"the zero: block (ZeRO stage {c.zero_stage} over {', '.join(c.zero_axes)})")
    if c.pipeline_axis is not None:
        blocks.append(f"the pipeline: block ({c.pipeline_stages} stages on {c.pipeline_axis}, {c.schedule})")
    if c.recompute != "none":
        blocks.append(f"the recompute: block ({c.recompute})")
    if blocks:
        raise not_written(target, " and ".join(blocks), "this export writes the layouts only",
                          "export --to torch writes ZeRO and recomputation; or take the blocks out of the spec to "
                          "export its layouts alone")


def batch_lines(plan: ExportPlan, comment: str = "#") -> list[str]:
    """The step's batch (the spec's ``training:`` block, and a pipeline's micro-batches) as constants."""
    c = plan.config
    return [f"{comment}: the step's batch (the spec's training: block): sequences an optimizer step trains, and one",
            f"{comment}: micro-batch on one data-parallel rank",
            f"GLOBAL_BATCH = {c.global_batch!r}", f"MICRO_BATCH = {c.micro_batch!r}"]
