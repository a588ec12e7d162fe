"""A spec's ``zero:``, ``recompute:`` and ``pipeline:`` blocks, read the same way by ``check``, ``run``,
``estimate`` and ``pipeline`` (:func:`read_blocks`), and the blocks' transforms of an analysed graph
(:func:`transform`), in the order of docs/zero-and-recompute.md: ``Zero`` on the forward graph, the
analysis (backward, reshard), ``Recompute``, ``zero.finish``.

A flag given on the command line (``estimate --zero``, ``--recompute``, ``--recompute-layers``) wins over
the block; :attr:`Blocks.notes` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layout_prop.core.errors import cut
from layout_prop.core import meta

__all__ = ["Blocks", "read_blocks", "transform", "describe"]


@dataclass
class Blocks:
    """What a spec's blocks (or the flags over them) ask for."""

    zero: Any = None  # an io.spec_blocks.ZeroConfig, None without a zero: block (or --zero)
    recompute: str = "none"
    layers: tuple[str, ...] | None = None
    pipeline: Any = None  # an io.spec_blocks.PipelineConfig, None without a pipeline: block
    notes: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.zero is not None and self.zero.stage) or self.recompute != "none" or self.pipeline is not None

    @property
    def zero_stage(self) -> int:
        return self.zero.stage if self.zero is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """The configuration read, as JSON (``null`` where a block is absent)."""
        p = self.pipeline
        return {"zero": None if self.zero is None else self.zero.to_dict(),
                "recompute": {"mode": self.recompute, "layers": None if self.layers is None else list(self.layers)},
                "pipeline": None if p is None else {"axis": p.axis, "stages": p.stages, "micro_batches": p.micro_batches,
                                                    "schedule": p.schedule, "virtual_stages": p.virtual_stages}}


def read_blocks(graph, *, zero: int | None = None, recompute: str | None = None,
                recompute_layers: str | None = None) -> Blocks:
    """The spec's blocks, checked (a bad one is its one-line typed error: ``bad-pipeline``, ``bad-value``,
    ``unknown-key``...), with the flags ``--zero`` (``zero``), ``--recompute`` and ``--recompute-layers`` (their
    text, ``None`` where not given) over them."""
    from layout_prop.io.spec_blocks import parse_pipeline, parse_recompute, parse_zero

    out = Blocks()
    block_zero, block_recompute = graph.meta.get(meta.ZERO), graph.meta.get(meta.RECOMPUTE)
    if block_zero is not None:
        out.zero = parse_zero(block_zero, graph.mesh)
    if block_recompute is not None:
        out.recompute, out.layers = parse_recompute(block_recompute)
    if graph.meta.get(meta.PIPELINE) is not None:
        out.pipeline = parse_pipeline(graph.meta[meta.PIPELINE], graph.mesh)
    flag_zero = zero
    if flag_zero is not None:
        flag = parse_zero(flag_zero, graph.mesh, path="--zero")
        if out.zero is not None and out.zero != flag:
            out.notes.append(f"--zero {flag_zero} given: the spec's zero: block ({_zero_text(out.zero)}) is not read")
        out.zero = flag
    flag_mode, flag_layers = recompute, recompute_layers
    if flag_mode == "none" and flag_layers is not None:
        from layout_prop.core.errors import SpecError

        raise SpecError("bad-usage", f"--recompute none with --recompute-layers {cut(flag_layers)}: no layer is "
                        "recomputed in mode none", path="--recompute-layers",
                        hint="give --recompute full (or selective) with --recompute-layers, or drop one of them")
    if flag_mode is not None or flag_layers is not None:
        before = (out.recompute, out.layers)
        if flag_mode is not None:
            out.recompute = flag_mode
        if flag_layers is not None:
            out.layers = tuple(x.strip() for x in flag_layers.split(",") if x.strip())
            if not out.layers:
                from layout_prop.core.errors import SpecError

                raise SpecError("bad-value", f"--recompute-layers {flag_layers!r} names no layer",
                                path="recompute.layers", hint="name the layers, like --recompute-layers l0,l1")
            out.recompute = "full" if out.recompute == "none" else out.recompute
        if block_recompute is not None and before != (out.recompute, out.layers):
            given = " ".join(f for f, v in (("--recompute", flag_mode), ("--recompute-layers", flag_layers)) if v)
            out.notes.append(f"{given} given: the spec's recompute: block ({_recompute_text(*before)}) is not read")
    if out.recompute != "none" and out.layers is not None:  # its layers named, with or without --backward
        from layout_prop.passes.recompute import segments

        segments(graph, "full", out.layers)  # (bad-value at recompute.layers naming the graph's layers)
    return out


def _zero_text(zero) -> str:
    return f"stage {zero.stage} over {', '.join(zero.axes) or 'no axis'}"


def _recompute_text(mode: str, layers) -> str:
    return mode + ("" if layers is None else f" of {', '.join(layers)}")


def describe(blocks: Blocks) -> str:
    """``ZeRO stage 3 over dp, recompute full, pipeline 2 stages on pp (1f1b, 4 micro-batches)``."""
    parts = []
    if blocks.zero is not None and blocks.zero.stage:
        parts.append(f"ZeRO {_zero_text(blocks.zero)}")
    if blocks.recompute != "none":
        parts.append(f"recompute {_recompute_text(blocks.recompute, blocks.layers)}")
    p = blocks.pipeline
    if p is not None:
        v = f", {p.virtual_stages} virtual" if p.virtual_stages > 1 else ""
        parts.append(f"pipeline {p.stages} stages on {p.axis} ({p.schedule}{v}, {p.micro_batches} micro-batches)")
    return ", ".join(parts) or "none"


def forward(graph, blocks: Blocks):
    """The forward graph with ZeRO stage 3's stored shards and gathers (stages 0-2 change no forward node)."""
    if blocks.zero is not None and blocks.zero.stage:
        from layout_prop.passes.zero import Zero

        return Zero(blocks.zero).run(graph)
    return graph


def transform(analysed, blocks: Blocks):
    """An analysed graph (backward and reshard done) with the blocks' later passes: ``Recompute``, then
    ``zero.finish`` (stage 3's re-gathers; stages 1 and 2: the gradients reduce-scattered to the ZeRO shard)."""
    g = analysed
    if blocks.recompute != "none":
        from layout_prop.passes.recompute import Recompute

        g = Recompute(blocks.recompute, blocks.layers).run(g)
    if blocks.zero is not None and blocks.zero.stage:
        from layout_prop.passes.zero import finish

        g = finish(g, blocks.zero)
    return g
