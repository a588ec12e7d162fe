"""The work of ``layout-prop run``: a spec (or ``MODEL --plan PLAN`` with the model's own weights,
:func:`load_with_weights`) executed on every rank and compared with one device, its ``zero:`` and
``recompute:`` blocks applied (:func:`run_spec`) or its ``pipeline:`` block's program run
(:func:`run_pipelined`); the ``--inputs`` file read without unpickling anything (:func:`read_inputs`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from layout_prop.core import meta
from layout_prop.core.errors import SpecError, cut

__all__ = ["run_spec", "run_pipelined", "read_inputs", "load_with_weights", "MAX_INPUTS_BYTES"]

#: the largest ``--inputs`` file read (its bytes are read whole, then parsed by numpy): 2 GiB
MAX_INPUTS_BYTES = 2 ** 31
_NPZ_HINT = "write it with numpy.savez(FILE, name=array, ...), one array per graph input name"


def read_inputs(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file by name, read without unpickling anything.

    Raises
    ------
    SpecError
        ``inputs-not-found`` (cannot be read), ``inputs-too-large`` (over
        :data:`MAX_INPUTS_BYTES`), ``bad-inputs`` (not an .npz archive, a damaged one, or an array
        stored as a pickle: object arrays are refused, ``allow_pickle=False``).
    """
    import zipfile

    from layout_prop.io.loader import read_file_bytes

    data = read_file_bytes(path, MAX_INPUTS_BYTES, what="inputs", missing="inputs-not-found",
                           too_large="inputs-too-large", hint="check the path; " + _NPZ_HINT)
    where = str(path)
    if not data.startswith(b"PK"):
        what = "a single .npy array" if data.startswith(b"\x93NUMPY") else "not an .npz archive"
        raise SpecError("bad-inputs", f"{cut(where)} is {what}", path=where, hint=_NPZ_HINT)
    arrays = {}
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            for name in archive.files:
                arrays[name] = archive[name]
    except ValueError as exc:
        if "pickle" in str(exc) or "Object arrays" in str(exc):
            raise SpecError("bad-inputs", f"{cut(where)} holds an array stored as a pickle (dtype object), which is "
                            "never loaded", path=where, hint="save numeric or bool arrays only") from None
        raise SpecError("bad-inputs", f"{cut(where)} cannot be read as .npz: {_first_line(exc)}", path=where,
                        hint=_NPZ_HINT) from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise SpecError("bad-inputs", f"{cut(where)} cannot be read as .npz: {_first_line(exc)}", path=where,
                        hint=_NPZ_HINT) from None
    return arrays


def _first_line(exc: Exception) -> str:
    return cut((str(exc).splitlines() or [""])[0] or type(exc).__name__)


def load_with_weights(spec, plan=None, opaque: bool = False) -> tuple:
    """``(graph, weights, unread)``: the graph :func:`.model_input.load_graph` gives, and for ``MODEL --plan
    PLAN`` (``spec``, ``plan``; ``opaque``: ``--opaque``) the model's own value of each weight and constant input (by input name, from
    ``graph.meta["import_sources"]``), with the names of those whose data was not read (kept
    in external data files: they are drawn at random)."""
    from layout_prop.frontends import is_model_path

    from .model_input import load_graph

    if not is_model_path(str(spec)) or plan is None:
        return load_graph(spec, plan, opaque), {}, []  # (load_graph refuses a model without a plan)
    from layout_prop.core.dependencies import require_model_reader
    from layout_prop.core.graph import paused_gc
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    require_model_reader(str(spec))
    sharding = load_plan(Path(plan))
    with paused_gc():
        model = read_model(spec, sharding)
        graph = build_graph(model, sharding, opaque=opaque)
    weights, unread = {}, []
    for name, value in graph.meta[meta.IMPORT_SOURCES].items():
        const = model.values[value].const if value in model.values else None
        if const is None:
            continue
        if _unread(const):
            unread.append(name)
        else:
            weights[name] = const
    return graph, weights, unread


def _unread(array: np.ndarray) -> bool:
    """A tensor the importer did not read (``frontends.limits.unread``: read-only zeros of
    stride 0 that take no memory)."""
    return array.size > 1 and not array.flags.writeable and all(s == 0 for s in array.strides)


def run_spec(graph, blocks, *, engine: str = "sim", backend: str = "numpy", backward: bool = False, seed: int = 0,
             reshard: bool = True, rtol: float | None = None, max_memory: int | None = None,
             max_time: float | None = None, weights: dict | None = None, from_file: dict | None = None,
             unread: list[str] = (), options: dict | None = None):
    """``layout-prop run``'s work on a spec without a ``pipeline:`` block (:func:`run_pipelined` has one):
    :func:`layout_prop.runner.run_graph` with the spec's ``zero:``/``recompute:`` blocks (``blocks``,
    :func:`.blocks.read_blocks`) applied (the forward with ZeRO-3's gathers, with ``backward`` the
    recomputation and ZeRO's finish; the reference is the spec's graph without them), then on the simulator
    ZeRO's optimizer step on the shards.  ``weights`` (the model's own, :func:`load_with_weights`) and
    ``from_file`` (``--inputs``, checked) are the inputs given; ``options`` the mindspore engine's.  Returns the
    :class:`~layout_prop.runner.RunReport`, with ``extra["inputs"]`` (where each input came from) and, with
    blocks, ``extra["config"]``."""
    from layout_prop.runner import run_graph

    weights, from_file = weights or {}, from_file or {}
    configured, transformed = {}, {}
    if blocks.any:
        configured = _configured(graph, blocks, transformed, reshard, backward)
        graph = configured.pop("graph")
    given = {**weights, **from_file}
    rep = run_graph(graph, engine=engine, backend=backend, backward=backward, seed=seed, reshard=reshard, rtol=rtol,
                    max_memory=max_memory, max_time=max_time, inputs=given, **configured, **(options or {}))
    rep.extra["inputs"] = _input_sources(graph, weights, from_file, list(unread))
    if rep.ok and "graph" in transformed and blocks.zero_stage and engine == "sim":
        _optimizer_step(rep, transformed["graph"], blocks, rtol, seed, given)
    if blocks.any:
        rep.extra["config"] = {**blocks.to_dict(), "note": _configured_note(blocks, backward, rep)}
        rep.notes.append(f"config: {rep.extra['config']['note']}")
    return rep


def run_pipelined(graph, blocks, *, engine: str = "sim", seed: int = 0, backward: bool = False,
                  timeout: float | None = None, max_memory: int | None = None, max_time: float | None = None,
                  progress=None) -> dict:
    """``layout-prop run``'s work on a spec with a ``pipeline:`` block: the pipelined program executed as
    ``layout-prop pipeline --run`` executes it (:func:`.pipeline.build` and :func:`.pipeline.run_pipeline`,
    with the zero:/recompute: blocks), on every rank over the micro-batches, compared with one device on the
    whole batch.  Returns run_pipeline's record with ``"config"`` (its ``"note"`` says what ran)."""
    from .pipeline import build, run_pipeline

    say = progress if progress is not None else (lambda text: None)
    options = {"backend": "numpy", "timeout": 300.0 if timeout is None else timeout} if engine == "mindspore" else {}
    say("analysing and lowering one micro-batch")
    built = build(graph, "a100-80g", blocks.zero, (blocks.recompute, blocks.layers))
    report = run_pipeline(built, seed, engine, progress=progress, max_memory=max_memory, max_time=max_time,
                          **options)
    note = (f"{_describe(blocks)}: the pipelined program executed as layout-prop pipeline SPEC --run executes it "
            f"(one micro-batch's program on the stage mesh {built.program.program.mesh}, each stage's schedule, "
            f"the moves), forward and backward{'' if backward else ' (a schedule is of both: without --backward too)'}; "
            f"compared with one device on the whole batch"
            + ("; ZeRO's optimizer step is not run in a pipelined run" if blocks.zero_stage else ""))
    report["config"] = {**blocks.to_dict(), "note": note}
    return report


def _configured(graph, blocks, transformed: dict, reshard: bool, backward: bool) -> dict:
    """run_graph's arguments for a spec's zero:/recompute: blocks: the forward graph with ZeRO-3's gathers,
    the recomputation and ZeRO's finish applied to the analysed graph (with ``--backward``; the result is
    kept in ``transformed["graph"]``), and the reference: the spec's graph analysed without them (a copy,
    so that no node's metadata is shared)."""
    from layout_prop.api import analyze

    from .blocks import forward, transform

    plain = analyze(graph.copy_structure(), reshard=reshard, backward=backward)
    out = {"graph": forward(graph, blocks)}
    if plain.ok:
        out["reference_graph"] = plain.graph
        if plain.expanded:  # judge an expansion (a ring...) against the graph as written, as run_graph does
            out["reference_graph"] = analyze(graph.copy_structure(), reshard=False, backward=backward).graph
    if backward:
        def apply(analysed):
            transformed["graph"] = transform(analysed, blocks)
            return transformed["graph"]
        out["transform"] = apply
    return out


def _optimizer_step(rep, graph, blocks, rtol, seed: int, given: dict) -> None:
    """ZeRO's update executed (engines/training.py ``training_step``): each rank updates its shard of every
    parameter from the gradients the run made (SGD with weight decay: its update is exact in every dtype,
    where AdamW's first step divides by a gradient's magnitude), the stage's all-gathers put the parameters
    back, and they are compared with one device's update.  A mismatch fails the run."""
    from layout_prop.engines.training import SGD, training_step
    from layout_prop.passes.lower import Lower
    from layout_prop.passes.zero import shard_layouts
    from layout_prop.runner import TOLERANCES, random_inputs

    dtypes = {s.dtype for n in graph.nodes for s in n.meta.get(meta.SPECS, ()) if s is not None}
    rtol = rtol if rtol is not None else max((TOLERANCES.get(d, 0.0) for d in dtypes), default=1e-5)
    inputs = {**random_inputs(graph, seed, given=given), **given}  # the run's own draw
    step = training_step(graph, Lower().run(graph).program, inputs, shard_layouts(graph, blocks.zero),
                         blocks.zero.stage, SGD(lr=0.1, weight_decay=0.01), rtol=rtol)
    rep.extra["optimizer_step"] = step.to_dict()
    if not step.ok:
        rep.ok = False
        rep.mismatches.extend(f"optimizer step: {m}" for m in step.mismatches)


def _configured_note(blocks, backward: bool, rep) -> str:
    """What of the zero:/recompute: blocks the run executed, and what not."""
    from .blocks import describe

    if not rep.executed:
        return f"{describe(blocks)}: nothing executed (violations)"
    ran, not_run = [], []
    if blocks.zero is not None and blocks.zero.stage == 3:
        ran.append("ZeRO-3's parameters stored sharded and gathered" + (", re-gathered for the backward, gradients "
                                                                       "reduce-scattered" if backward else ""))
    elif blocks.zero is not None and blocks.zero.stage:
        (ran if backward else not_run).append(f"ZeRO-{blocks.zero.stage}'s gradient reduce-scatters")
    if blocks.recompute != "none":
        (ran if backward else not_run).append("the recomputation copies")
    text = f"{describe(blocks)}: "
    text += (f"executed {' and '.join(ran)} and compared with the spec's graph without them on one device"
             if ran else "nothing of it executed")
    if not_run:
        text += f"; {' and '.join(not_run)} act on the backward: add --backward"
    if "optimizer_step" in rep.extra:
        text += "; then one optimizer step on the ZeRO shards, all-gathered after, compared with one device's"
    elif blocks.zero is not None and blocks.zero.stage:
        text += ("; the optimizer's update of each shard is not run (with --backward on the simulator it is: "
                 "engines/training.py training_step)")
    return text


def _describe(blocks) -> str:
    from .blocks import describe

    return describe(blocks)


def _input_sources(graph, weights: dict, from_file: dict, unread: list[str]) -> dict[str, list[str]]:
    """Where each graph input's value came from: ``{"file": [...], "model": [...], "random": [...]}``
    (``unread``: the model's weights not read from external data, drawn at random)."""
    names = [node.name for node in graph.inputs()]
    return {"file": [n for n in names if n in from_file],
            "model": [n for n in names if n in weights and n not in from_file],
            "random": [n for n in names if n not in from_file and n not in weights],
            "unread": [n for n in unread if n not in from_file]}
