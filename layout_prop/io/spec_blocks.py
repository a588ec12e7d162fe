"""A spec's training-configuration blocks, read beside the spec loader: ``zero:`` (:func:`parse_zero` ->
:class:`ZeroConfig`), ``recompute:`` (:func:`parse_recompute` -> ``(mode, layers)``) and ``pipeline:``
(:func:`parse_pipeline`, ``PipelineConfig.from_spec`` -> :class:`PipelineConfig`, with the schedule request's
check, :func:`check_schedule_request`).

Each is checked here, with a typed error (``bad-value``, ``unknown-key`` with a did-you-mean, ``bad-pipeline``)
that names the block's key; the passes that act on them (``passes/zero.py``, ``passes/recompute.py``,
``passes/pipeline.py``, ``passes/schedule.py``) take the parsed value objects and re-export these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from layout_prop.core.errors import SpecError, cut
from layout_prop.core.mesh import DeviceMesh

__all__ = ["ZeroConfig", "parse_zero", "DATA_AXES", "STAGES", "parse_recompute", "MODES", "PipelineConfig",
           "parse_pipeline", "check_schedule_request", "SCHEDULES", "MAX_TASKS", "TrainingBlock", "parse_training"]


# --------------------------------------------------------------------------- zero:
#: the mesh axis names that mean data parallelism (as :data:`layout_prop.perf.step.DATA_AXES`)
DATA_AXES = ("dp", "data", "fsdp")
STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroConfig:
    """A ZeRO stage and the mesh axes the training state is sharded over.

    ``axes`` are mesh axis names (data-parallel ones); empty means stage 0 (nothing sharded).
    """

    stage: int
    axes: tuple[str, ...]

    def degree(self, mesh) -> int:
        """How many ranks share one parameter's state: the product of the ``axes``' sizes."""
        return math.prod(mesh.shape[mesh.axis_index(a)] for a in self.axes) if self.stage else 1

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "axes": list(self.axes)}


def parse_zero(value: Any, mesh, path: str = "zero") -> ZeroConfig:
    """The ``zero:`` block of a spec (or ``--zero N``): a stage, or ``{stage: N, axes: [..]}``.

    ``axes`` default to every mesh axis named dp, data or fsdp; each must be such an axis.

    >>> from layout_prop.core.mesh import DeviceMesh
    >>> m = DeviceMesh((2, 2, 2), ("dp", "fsdp", "tp"))
    >>> parse_zero(3, m), parse_zero({"stage": 2, "axes": ["fsdp"]}, m).axes
    (ZeroConfig(stage=3, axes=('dp', 'fsdp')), ('fsdp',))
    >>> parse_zero({"stage": 1, "axes": ["tp"]}, m)
    Traceback (most recent call last):
        ...
    layout_prop.core.errors.SpecError: bad-value at zero.axes: ZeRO shards over data-parallel axes, not 'tp' (hint: name mesh axes among ['dp', 'fsdp'] (axes named dp, data or fsdp))
    """
    data_axes = [name for name in mesh.names if name in DATA_AXES]
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"stage", "axes"}, key=lambda key: (type(key).__name__, str(key)))
        if unknown:
            raise SpecError("unknown-key", f"unknown key {cut(unknown[0])} in the zero block"
                            f"{_did_you_mean(unknown[0], ('stage', 'axes'))}", path=path,
                            hint="write zero: {stage: 1|2|3, axes: [dp]}")
        stage, axes = value.get("stage"), value.get("axes")
    else:
        stage, axes = value, None
    if type(stage) is not int or stage not in STAGES:  # (3.0 and True are refused, in a block as bare)
        raise SpecError("bad-value", f"ZeRO stage must be 0, 1, 2 or 3, got {cut(stage)}", path=f"{path}.stage"
                        if isinstance(value, dict) else path, hint="write zero: {stage: 3} (or --zero 3)")
    if axes is None:
        axes = data_axes
    if not isinstance(axes, list) or not all(isinstance(a, str) for a in axes):
        raise SpecError("bad-type", f"zero axes must be a list of mesh axis names, got {cut(axes)}",
                        path=f"{path}.axes", hint="write axes: [dp]")
    for axis in axes:
        if axis not in data_axes:
            raise SpecError("bad-value", f"ZeRO shards over data-parallel axes, not {cut(axis)}", path=f"{path}.axes",
                            hint=f"name mesh axes among {data_axes} (axes named dp, data or fsdp)")
    if len(set(axes)) != len(axes):
        raise SpecError("bad-value", f"zero axes name an axis twice: {axes}", path=f"{path}.axes",
                        hint="name each axis once")
    if stage and not axes:
        raise SpecError("bad-value", f"ZeRO stage {stage} needs a data-parallel mesh axis, the mesh has "
                        f"{list(mesh.names)}", path=path, hint="name a mesh axis dp (or data, fsdp)")
    return ZeroConfig(int(stage), tuple(a for a in mesh.names if a in axes) if stage else ())


# --------------------------------------------------------------------------- recompute:
MODES = ("none", "selective", "full")


def parse_recompute(value, path: str = "recompute") -> tuple[str, tuple[str, ...] | None]:
    """The ``recompute:`` block of a spec: a mode, or ``{mode: none|selective|full, layers: [l0, ...]}``
    (layers default to every layer); returns ``(mode, layers or None)``.

    >>> parse_recompute("selective"), parse_recompute({"mode": "full", "layers": ["l0", "l2"]})
    (('selective', None), ('full', ('l0', 'l2')))
    """
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"mode", "layers"}, key=lambda key: (type(key).__name__, str(key)))
        if unknown:
            raise SpecError("unknown-key", f"unknown key {cut(unknown[0])} in the recompute block"
                            f"{_did_you_mean(unknown[0], ('mode', 'layers'))}", path=path,
                            hint="write recompute: {mode: selective, layers: [l0, l1]}")
        mode, layers = value.get("mode"), value.get("layers")
    else:
        mode, layers = value, None
    if not isinstance(mode, str) or mode not in MODES:
        raise SpecError("bad-value", f"recompute mode must be one of {', '.join(MODES)}, got {cut(mode)}",
                        path=f"{path}.mode" if isinstance(value, dict) else path, hint="write recompute: full")
    if layers is not None and (not isinstance(layers, list) or not all(isinstance(x, str) for x in layers)):
        raise SpecError("bad-type", f"recompute layers must be a list of layer names, got {cut(layers)}",
                        path=f"{path}.layers", hint="name layers as the nodes do: layers: [l0, l1]")
    if layers is not None and not [x for x in layers if x.strip()]:  # as --recompute-layers ,,, is
        raise SpecError("bad-value", f"recompute layers {cut(layers)} name no layer", path=f"{path}.layers",
                        hint="name the layers, like layers: [l0, l1], or leave layers out (every layer)")
    if mode == "none" and layers is not None:
        raise SpecError("bad-value", f"recompute mode none names layers {cut(layers)} to recompute", path=path,
                        hint="write mode: full (or selective) with layers, or drop the layers")
    return mode, None if layers is None else tuple(layers)


# --------------------------------------------------------------------------- pipeline:
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: the most (micro-batch, chunk) pairs a schedule is written out for (each has a forward and a backward task)
MAX_TASKS = 1 << 20
_KEYS = {"axis", "micro_batches", "schedule", "virtual_stages", "boundaries", "layers", "batch_inputs", "loss"}


def check_schedule_request(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Refuse a schedule that cannot be made, with a typed error (``bad-pipeline``)."""
    if kind not in SCHEDULES:
        raise SpecError("bad-pipeline", f"unknown pipeline schedule {cut(kind)}", path="pipeline.schedule",
                        hint=f"use one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError("bad-pipeline", f"pipeline {name} must be a positive integer, got {cut(value)}",
                            path=f"pipeline.{name}", hint=f"for example {name}: 2")
    if stages * virtual_stages * micro_batches > MAX_TASKS:
        raise SpecError("bad-pipeline", f"{cut(stages)} stages x {cut(virtual_stages)} virtual x {cut(micro_batches)} "
                        f"micro-batches make more than {MAX_TASKS:,} forward tasks", path="pipeline.micro_batches",
                        hint="use fewer micro-batches or virtual stages")
    if kind != "interleaved" and virtual_stages != 1:
        raise SpecError("bad-pipeline", f"virtual_stages {cut(virtual_stages)} needs schedule interleaved, not {cut(kind)}",
                        path="pipeline.virtual_stages", hint="use schedule: interleaved, or drop virtual_stages")
    if kind == "interleaved" and micro_batches % stages:
        raise SpecError("bad-pipeline", f"the interleaved schedule needs micro_batches a multiple of the "
                        f"{stages} stages, got {micro_batches}", path="pipeline.micro_batches",
                        hint=f"use {stages * max(1, round(micro_batches / stages))} micro-batches (as Megatron-LM "
                             f"requires)")


def _bad(message: str, path: str, hint: str) -> SpecError:
    return SpecError("bad-pipeline", message, path=path, hint=hint)


@dataclass(frozen=True)
class PipelineConfig:
    """What a ``pipeline:`` block asks for (module docstring); :meth:`from_spec` checks it."""

    axis: str = "pp"
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    boundaries: tuple = ()  # node names, or layer indices (int: that layer's first node)
    layers: tuple[int, ...] = ()
    batch_inputs: tuple[str, ...] | None = None
    loss: str = "mean"
    stages: int = 1  # the pipeline axis's size (set by from_spec)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

    @classmethod
    def from_spec(cls, block: dict, mesh: DeviceMesh) -> "PipelineConfig":
        """The config of a ``pipeline:`` mapping on ``mesh``; ``SpecError`` ``bad-pipeline`` when unusable
        (also :func:`parse_pipeline`)."""
        if not isinstance(block, dict):
            raise _bad(f"pipeline must be a mapping, got {cut(block)}", "pipeline", "write pipeline: {axis: pp}")
        unknown = sorted(set(block) - _KEYS, key=lambda key: (type(key).__name__, str(key)))
        if unknown:
            raise _bad(f"unknown pipeline key(s) {cut(unknown)}{_did_you_mean(unknown[0], _KEYS)}",
                       f"pipeline.{cut(unknown[0])}",
                       f"the keys are {', '.join(sorted(_KEYS))}")
        axis = block.get("axis", "pp")
        if axis not in mesh.names:
            raise _bad(f"the pipeline axis {cut(axis)} is not a mesh axis (mesh {mesh})", "pipeline.axis",
                       f"add {axis} to the mesh, or name one of {', '.join(mesh.names)}")
        kind = block.get("schedule", "1f1b")
        stages = mesh.shape[mesh.names.index(axis)]
        m, v = block.get("micro_batches", 1), block.get("virtual_stages", 1)
        check_schedule_request(kind, stages, m, v)
        boundaries, layers = block.get("boundaries", ()), block.get("layers", ())
        if boundaries and layers:
            raise _bad("give boundaries or layers, not both", "pipeline.layers", "drop one of them")
        if not isinstance(boundaries, (list, tuple)) or not all(
                isinstance(b, str) or (isinstance(b, int) and not isinstance(b, bool) and b >= 0) for b in boundaries):
            raise _bad(f"boundaries must be a list of node names or layer indices, got {cut(boundaries)}",
                       "pipeline.boundaries", "write boundaries: [l2_h] (a node) or [2] (layer 2's first node)")
        if not isinstance(layers, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers):
            raise _bad(f"layers must be a list of positive layer counts, got {cut(layers)}", "pipeline.layers",
                       "write layers: [3, 2, 2, 1] (one count per chunk)")
        chunks = stages * v
        if boundaries and len(boundaries) != chunks - 1:
            raise _bad(f"{len(boundaries)} boundaries for {chunks} chunks ({stages} stages x {v} virtual)",
                       "pipeline.boundaries", f"name the first node of each chunk but the first: {chunks - 1} names")
        if layers and len(layers) != chunks:
            raise _bad(f"{len(layers)} layer counts for {chunks} chunks ({stages} stages x {v} virtual)",
                       "pipeline.layers", f"give {chunks} counts")
        batch = block.get("batch_inputs")
        if batch is not None and (not isinstance(batch, (list, tuple)) or not all(isinstance(b, str) for b in batch)):
            raise _bad(f"batch_inputs must be a list of input names, got {cut(batch)}", "pipeline.batch_inputs",
                       "write batch_inputs: [tokens, labels]")
        loss = block.get("loss", "mean")
        if loss not in ("mean", "sum"):
            raise _bad(f"loss must be mean or sum, got {cut(loss)}", "pipeline.loss",
                       "mean: the batch loss is the mean of the micro-batch losses")
        return cls(axis, m, kind, v, tuple(boundaries), tuple(layers), None if batch is None else tuple(batch),
                   loss, stages)


def parse_pipeline(block: Any, mesh: DeviceMesh) -> PipelineConfig:
    """The ``pipeline:`` block of a spec on ``mesh`` (:meth:`PipelineConfig.from_spec`)."""
    return PipelineConfig.from_spec(block, mesh)


def _did_you_mean(key, known) -> str:
    """`` (did you mean 'stage'?)`` for a key close to a known one, else ``''`` (any key type)."""
    import difflib

    close = difflib.get_close_matches(str(key)[:64], list(known), n=1) if isinstance(key, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class TrainingBlock:
    """A spec's ``training:`` block: the sequences an optimizer step trains (``global_batch``) and the sequences of
    one micro-batch on one data-parallel rank (``micro_batch``); docs/spec-format.md."""

    global_batch: int
    micro_batch: int

    def to_dict(self) -> dict[str, int]:
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch}


def parse_training(block: Any, path: str = "training") -> TrainingBlock:
    """A checked :class:`TrainingBlock` from a spec's ``training:`` mapping (both keys, positive integers).

    >>> parse_training({"global_batch": 512, "micro_batch": 2})
    TrainingBlock(global_batch=512, micro_batch=2)
    >>> parse_training({"global_batch": 512})
    Traceback (most recent call last):
    ...
    layout_prop.core.errors.SpecError: missing-key at training: the training block needs global_batch and micro_batch (hint: write training: {global_batch: 512, micro_batch: 1})
    """
    hint = "write training: {global_batch: 512, micro_batch: 1}"
    if not isinstance(block, dict):
        raise SpecError("bad-type", f"training must be a mapping, got {cut(block)}", path=path, hint=hint)
    unknown = sorted(str(k) for k in block if k not in ("global_batch", "micro_batch"))
    if unknown:
        raise SpecError("unknown-key", f"the training block has no key(s) {unknown}", path=f"{path}.{unknown[0]}",
                        hint="known keys: global_batch, micro_batch")
    if "global_batch" not in block or "micro_batch" not in block:
        raise SpecError("missing-key", "the training block needs global_batch and micro_batch", path=path, hint=hint)
    values = {}
    for key in ("global_batch", "micro_batch"):
        value = block[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError("bad-value", f"training.{key} is {cut(value)}, not a positive integer",
                            path=f"{path}.{key}", hint=hint)
        values[key] = value
    if values["global_batch"] % values["micro_batch"]:
        raise SpecError("bad-value", f"training.global_batch {values['global_batch']} is not a multiple of "
                        f"micro_batch {values['micro_batch']}", path=path, hint=hint)
    return TrainingBlock(**values)
