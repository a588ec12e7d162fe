"""The work of ``layout-prop export SPEC|MODEL --to hyper-parallel|mindspore|torch``: the checked plan
(:func:`export_text`: the analysis with reshard, :func:`layout_prop.interop.export_plan.collect`) and the
target's module text from its writer (``layout_prop/interop/export_<target>.py``); the graph read with the
model's own parameter names (:func:`load_export_graph`).
"""

from __future__ import annotations

from pathlib import Path

from layout_prop.core import meta

__all__ = ["export_text", "collect_plan", "stage_collect", "pipeline_chunks", "UnresolvedViolations", "check_inputs",
           "load_export_graph", "with_input_hint", "TARGETS"]

#: the export targets, each a writer module of layout_prop/interop/ (:func:`_writers`)
TARGETS = ("hyper-parallel", "mindspore", "torch")


def _writers():
    from layout_prop.interop.export_hyper_parallel import export_hyper_parallel
    from layout_prop.interop.export_mindspore import export_mindspore
    from layout_prop.interop.export_torch import export_torch

    return {"hyper-parallel": export_hyper_parallel, "mindspore": export_mindspore, "torch": export_torch}


class UnresolvedViolations(Exception):
    """The spec has violations that ``check --reshard`` cannot fix: nothing is exported (exit 1, as check)."""

    def __init__(self, violations):
        super().__init__(f"{len(violations)} violation(s)")
        self.violations = list(violations)


def export_text(graph, target: str, *, data_inputs=None, source: str = "", aliases=None):
    """``(plan, code)``: the :class:`~layout_prop.interop.export_plan.ExportPlan` of ``graph`` and ``target``'s module text."""
    from layout_prop.api import analyze
    from layout_prop.interop.export_plan import drop_unit_axes

    analysis = analyze(graph, reshard=True)
    if not analysis.ok:  # a plan that does not check is not written as one that did
        raise UnresolvedViolations(analysis.check.violations)
    done = analysis.graph
    plan = collect_plan(graph, done, data_inputs=data_inputs, source=source, nodes=target == "mindspore",
                        aliases=aliases if aliases is not None else graph.meta.get(meta.IMPORT_ALIASES))
    return plan, _writers()[target](drop_unit_axes(plan))  # the data keeps the spec's mesh (it round-trips)


def with_input_hint(err, guessed: bool):
    """``err``, a ``not-expressible`` layout of a *parameter*, with a hint naming ``--input`` when ``guessed``
    (a spec exported without ``--input``: every graph input was taken as a parameter, so the tensor the
    target cannot place as a weight may be the batch); any other error as it is."""
    from layout_prop.core.errors import LayoutPropError

    if not (guessed and isinstance(err, LayoutPropError) and err.code == "not-expressible"
            and " of parameter " in err.message):
        return err
    hint = (f"{err.hint}; " if err.hint else "") + ("or, if it is a model input (activations, token ids), "
                                                    "name it with --input NAME: without --input a spec's input "
                                                    "that takes a gradient is a parameter unless its dim 0 is cut "
                                                    "on a data-parallel axis")
    return type(err)(err.code, err.message, path=err.path, node=err.node, input=err.input, hint=hint)


def check_inputs(names) -> None:
    """Refuse a ``--input`` named twice (``duplicate-input``, one line, exit 2), as a spec refuses a value
    listed twice in ``outputs`` and ``plan --search`` an axis given twice in ``--axes``.

    >>> from layout_prop.core.errors import SpecError
    >>> check_inputs(None), check_inputs(["x", "cos", "sin"])
    (None, None)
    >>> try:
    ...     check_inputs(["x", "cos", "x"])
    ... except SpecError as err:
    ...     print(err.code, err.message)
    duplicate-input 'x' is given twice
    """
    from layout_prop.core.errors import SpecError, cut

    seen = set()
    for name in names or ():
        if name in seen:
            raise SpecError("duplicate-input", f"{cut(name)} is given twice", path="--input",
                            hint="name each model input once")
        seen.add(name)


def load_export_graph(spec, plan=None, opaque: bool = False):
    """The graph of ``spec``: a spec as every command loads it, a model through the importer's
    ``build_graph`` (which records the model's own weight names, so its inputs are told from its parameters)."""
    from layout_prop.frontends import is_model_path


    from .model_input import load_graph

    if not is_model_path(str(spec)) or plan is None:
        return load_graph(spec, plan, opaque)  # a spec, or the missing-plan error
    from layout_prop.core.dependencies import require_model_reader
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    require_model_reader(str(spec))
    sharding = load_plan(Path(plan))
    model = read_model(spec, sharding)
    graph = build_graph(model, sharding, opaque=opaque)
    graph.meta[meta.IMPORT_ALIASES] = dict(model.spec_aliases)  # the other names of de-duplicated parameters
    return graph


def collect_plan(graph, done, *, data_inputs=None, source: str = "", nodes: bool = False, aliases=None):
    """:func:`~layout_prop.interop.export_plan.collect` of ``graph`` and ``done`` (``graph`` analysed as
    ``check --reshard`` does), with a pipelined plan's chunks (:func:`pipeline_chunks`) and stage
    (:func:`stage_collect`), which the export room cannot compute itself: they run the pipeline's passes."""
    from layout_prop.interop.export_plan import collect

    chunks = stage = None
    if graph.meta.get(meta.PIPELINE) is not None:
        chunks = pipeline_chunks(graph)
        stage = stage_collect(graph, data_inputs=data_inputs, source=source, aliases=aliases)
    return collect(graph, done, data_inputs=data_inputs, source=source, nodes=nodes, aliases=aliases,
                   chunks=chunks, stage=stage)


def stage_collect(graph, *, data_inputs=None, source: str = "", aliases=None):
    """:func:`~layout_prop.interop.export_plan.collect` of one micro-batch of ``graph`` (a spec with a
    ``pipeline:`` block) on the stage mesh, its op nodes included: the layouts each pipeline stage runs, as
    ``check SPEC --reshard`` analyses them (the whole graph analysed on the whole mesh may cut values on the
    pipeline axis, which no stage holds)."""
    from layout_prop.api import analyze
    from layout_prop.interop.export_plan import collect
    from layout_prop.io.spec_blocks import PipelineConfig
    from layout_prop.passes.pipeline import micro_batch_graph

    micro, _ = micro_batch_graph(graph, PipelineConfig.from_spec(graph.meta[meta.PIPELINE], graph.mesh))
    micro.meta.update({k: v for k, v in graph.meta.items() if k in (meta.IMPORT_SOURCES, meta.IMPORT_ALIASES)})
    return collect(micro, analyze(micro, reshard=True).graph, data_inputs=data_inputs, source=source, nodes=True,
                   aliases=aliases)


def pipeline_chunks(graph) -> dict[str, int]:
    """The chunk of every forward op node of ``graph``, a spec with a ``pipeline:`` block, cut as ``layout-prop
    pipeline SPEC`` cuts it (its boundaries or layers, else balanced by the step-time model on a100-80g, with the
    spec's ``zero:`` and ``recompute:`` blocks applied): one micro-batch analysed on the stage mesh and lowered.
    Nodes the passes inserted (moves, ZeRO's gathers, recomputed copies) and backward nodes are left out."""
    from layout_prop.io.spec_blocks import parse_recompute, parse_zero
    from layout_prop.passes.pipeline import CHUNK, POSITION, chunk_of_position
    from layout_prop.workflows.pipeline import build

    zero = parse_zero(graph.meta[meta.ZERO], graph.mesh) if graph.meta.get(meta.ZERO) is not None else None
    recompute = parse_recompute(graph.meta[meta.RECOMPUTE]) if graph.meta.get(meta.RECOMPUTE) is not None else ("none", None)
    built = build(graph, "a100-80g", zero, recompute, localize=False)
    forward = {n.name for n in graph.nodes if not n.is_input}
    total = built.config.chunks
    return {n.name: n.meta.get(CHUNK, chunk_of_position(n.meta[POSITION], total)) for n in built.micro.nodes
            if n.name in forward and POSITION in n.meta and not n.meta.get(meta.INSERTED_BY)}
