"""The work of ``layout-prop plan MODEL --search``: the whole parallel configuration ranked by predicted step
time, and the best written as a spec and a sharding plan.

The search is :func:`layout_prop.planner.search.search`; this module hands it the model's one-stage specs
(``gen``'s generators, :func:`generator_spec`) and their analysis (:func:`analysed`: the planner imports
neither), reads the model (:func:`load_search_graph`, :func:`load_model_shape`), and writes the best
(:func:`best_spec`, :func:`plan_file_text`) and the table (:func:`format_result`).

MODEL may be an imported model (``.onnx``, ``.mindir``; ``--plan`` optional: the search reads
only its sizes): a decoder-only Llama-family or GPT-2 model is priced as the ``gen`` model of
its sizes, ``-o`` writes that generator's graph, and ``--plan-out`` a sharding plan in the
model's own parameter names (:func:`imported_plan_text`), which ``import --plan`` reads back.
"""

from __future__ import annotations

import json

from layout_prop.core.errors import SpecError

__all__ = ["format_result", "search_notes", "best_spec", "plan_file_text", "generator_spec", "analysed",
           "load_model_shape", "run_search", "load_search_graph", "imported_plan_text", "ONE_RANK_PLAN"]


#: the plan an import is read with when ``plan --search MODEL`` is given no ``--plan`` (the search reads sizes only)
ONE_RANK_PLAN = {"mesh": {"shape": [1], "names": ["dp"]}}


def generator_spec(model, layers: int, tp: int, cp: int = 1, ep: int = 1, dp: int = 1, micro_batch: int = 1,
                   dense: int | None = None) -> dict:
    """``gen gpt|llama|moe``'s spec of ``model`` (a :class:`~layout_prop.planner.search.ModelShape`) with ``layers``
    layers on the mesh (dp, sp = cp, tp), or (dp, ep, tp) for MoE, ``micro_batch`` sequences a data rank; MoE:
    the first ``dense`` of them dense (default the model's own count)."""
    from layout_prop.frontends import generate as gen

    common = dict(seq=model.seq, hidden=model.hidden, heads=model.heads, ffn=model.ffn, dtype=model.dtype)
    if model.family == "moe":
        return gen.moe_spec(layers, (("dp", dp), ("ep", ep), ("tp", tp)), batch=micro_batch * dp * ep,
                            experts=model.experts, top_k=model.top_k, shared_experts=model.shared_experts,
                            router=model.router, capacity_factor=model.capacity_factor,
                            capacity_scope=model.capacity_scope, kv_heads=model.kv_heads, full=model.full,
                            vocab=model.vocab, tie_embeddings=model.tie,
                            dense_layers=min(model.dense_layers if dense is None else dense, layers),
                            dense_ffn=model.dense_ffn, **common)
    mesh = (("dp", dp), ("sp", cp), ("tp", tp))
    if model.family == "gpt":
        return gen.gpt_spec(layers, mesh, batch=micro_batch * dp, vocab=model.vocab, **common)
    return gen.llama_spec(layers, mesh, batch=micro_batch * dp, kv_heads=model.kv_heads, full=model.full,
                          vocab=model.vocab, tie_embeddings=model.tie, **common)


def analysed(spec: dict):
    """The spec's graph analysed with its backward and resharded (what the step model reads)."""
    from layout_prop.api import analyze
    from layout_prop.io.loader import load_spec

    analysis = analyze(load_spec(spec), reshard=True, backward=True)
    if not analysis.ok:
        raise SpecError("search-layer", f"a one-stage graph of the search does not check: "
                        f"{analysis.check.violations[0]}", hint="report this: the generator's layouts should check")
    return analysis.graph


def load_search_graph(spec, plan=None, opaque: bool = False):
    """The graph the search reads: :func:`~layout_prop.workflows.model_input.load_graph`'s, except that a model file
    needs no ``--plan`` (read on one rank, :data:`ONE_RANK_PLAN`: the search takes only its sizes)."""
    from layout_prop.frontends import is_model_path

    from .model_input import load_graph

    if is_model_path(str(spec)) and plan is None:
        from layout_prop.core.dependencies import require_model_reader
        from layout_prop.frontends import load_model

        require_model_reader(str(spec))
        try:
            return load_model(str(spec), ONE_RANK_PLAN, opaque=opaque)
        except SpecError as err:
            if err.code != "dynamic-shape":
                raise
            raise SpecError("dynamic-shape", err.message.replace(" and the plan gives no example shape", ""),
                            path=str(spec), hint="give plan --search a --plan PLAN with the inputs' shapes, "
                            "like inputs: {input_ids: {shape: [1, 4096], placements: [R]}} on mesh {shape: [1], "
                            "names: [dp]} (the search reads the sequence length from them)") from None
    return load_graph(spec, plan, opaque)


def load_model_shape(graph):
    """The search's model of ``graph`` (its layers recognised), its one-stage specs written by ``gen``."""
    from dataclasses import replace

    from layout_prop.planner.search import recognise

    return replace(recognise(graph), builder=generator_spec)


def run_search(model, cluster, devices: int, global_batch: int, **kwargs):
    """:func:`layout_prop.planner.search.search` with the command's analysis (for benchmarks and tests)."""
    from layout_prop.planner.search import search

    return search(model, cluster, devices, global_batch, analysed, **kwargs)


def search_notes(result) -> list[str]:
    """The notes the best configuration adds to the result's own (a pipeline's: what -o writes)."""
    best = result.ranked[0].config
    notes = []
    if best.pp > 1:
        notes.append(f"-o writes the {best.pp} stages as a pp mesh axis with a pipeline: block (docs/pipeline.md); "
                     "check, run and estimate read the block (estimate simulates the schedule with the moves: within 6% "
                     "of this prediction where a move is short against a stage's micro-batch)")
    return notes


def format_result(result, top: int) -> str:
    """The top candidates as a table, the reason the first wins, and the search's size and time (times and memory
    in the unit that shows them: :func:`~layout_prop.planner.search.format_seconds`, ``format_bytes``)."""
    from layout_prop.planner.search import format_bytes, format_seconds

    lines = [f"plan --search: {result.model.describe()} on {result.devices:,} devices of {result.cluster}, "
             f"global batch {result.global_batch:,}, memory limit {format_bytes(result.memory_limit)} per rank",
             f"{result.candidates:,} candidates, {len(result.ranked):,} fit; {result.layer_evaluations} one-layer "
             f"estimates; {result.seconds:.1f} s",
             f"{'#':>3} {'step':>11} {'MFU':>6} {'TFLOP/s':>8} {'memory':>11}  configuration"]
    for i, cand in enumerate(result.ranked[:top], 1):
        lines.append(f"{i:>3} {format_seconds(cand.step_time_s):>11} {cand.mfu:>6.1%} {cand.tflops_per_device:>8.1f} "
                     f"{format_bytes(cand.memory_bytes):>11}  {cand.config.label()}")
    lines.append(f"why: {result.why()}")
    lines.append(f"uncertainty: {result.uncertainty()}")
    lines += [f"note: {n}" for n in result.notes + search_notes(result)]
    return "\n".join(lines)


def best_spec(result, order: tuple[str, ...] | None = None) -> dict:
    """The best configuration's spec: the model on its mesh, the axes in ``order`` (outermost first: the mapping
    onto the cluster's nodes), with its ``zero:``, ``recompute:`` and ``pipeline:`` blocks (docs/spec-format.md,
    docs/pipeline.md).  The batch is one micro-batch on every data-parallel rank; with pipeline stages, the
    pipeline's ``M`` micro-batches (the block cuts them)."""
    best = result.ranked[0]
    c = best.config
    m = int(best.parts["micro_batches"])
    model = result.model
    spec = model.spec(model.layers, c.tp, c.cp, c.ep, c.dp, c.micro_batch * (m if c.pp > 1 else 1))
    spec = _with_mesh_order(spec, c.pp, order)
    if c.zero:
        spec["zero"] = {"stage": c.zero, "axes": ["dp"]}
    if c.recompute != "none":
        spec["recompute"] = c.recompute
    if c.pp > 1:
        spec["pipeline"] = {"axis": "pp", "micro_batches": m, "schedule": c.schedule,
                            "virtual_stages": c.v if c.schedule == "interleaved" else 1}
    # the step's batch, so that estimate SPEC needs no flags (docs/spec-format.md); estimate counts only the dp axis
    # as data-parallel, so an ep rank's sequences are in its micro-batch
    spec["training"] = {"global_batch": result.global_batch, "micro_batch": c.micro_batch * c.ep}
    return spec


def _with_mesh_order(spec: dict, pp: int, order: tuple[str, ...] | None) -> dict:
    """``spec`` with a ``pp`` axis (every input replicated on it) when ``pp > 1``, its mesh axes in ``order``
    (``sp`` is the search's ``cp``)."""
    from layout_prop.planner.search import DEFAULT_ORDER

    order = tuple("sp" if a == "cp" else a for a in (order or DEFAULT_ORDER))
    names = list(spec["mesh"]["names"])
    sizes = dict(zip(names, spec["mesh"]["shape"]))
    if pp > 1:
        sizes["pp"] = pp
    new = [a for a in order if a in sizes] + [a for a in names if a not in order]
    if new == names and pp == 1:
        return spec
    where = {a: i for i, a in enumerate(names)}
    for entry in spec["inputs"].values():
        old = entry["placements"]
        entry["placements"] = [old[where[a]] if a in where else "R" for a in new]
    spec["mesh"] = {"shape": [sizes[a] for a in new], "names": new}
    return spec


def plan_file_text(result, order: tuple[str, ...] | None = None) -> str:
    """The best configuration as a sharding plan (the mesh and every parameter's placements), the configuration
    itself in the header comments (a plan file has no key for it)."""
    import yaml

    if result.model.imported is not None:
        return imported_plan_text(result, order)
    spec = best_spec(result, order)
    best = result.ranked[0]
    params = {name: entry["placements"] for name, entry in spec["inputs"].items()
              if entry.get("requires_grad", True) and entry.get("dtype") not in ("int64", "int32")}
    header = [f"# layout-prop plan --search: the best of {result.candidates:,} candidates on {result.devices:,} "
              f"devices of {result.cluster}",
              f"# configuration: {best.config.label()}",
              f"# predicted step {best.step_time_s * 1e3:,.3f} ms, MFU {best.mfu:.1%}, memory per rank "
              f"{int(best.memory_bytes):,} bytes",
              "# " + json.dumps({"search": best.config.to_dict()})]
    body = yaml.safe_dump({"mesh": spec["mesh"], "parameters": params}, sort_keys=False, default_flow_style=None)
    return "\n".join(header) + "\n" + body


#: the tensor-parallel preset of each projection role (Megatron's pairs: q, k, v, gate, up column-parallel, o and
#: down row-parallel; the embedding by vocabulary rows, the head by its vocabulary columns)
_ROLE_PRESETS = {"q": "colwise", "k": "colwise", "v": "colwise", "gate": "colwise", "up": "colwise", "fc": "colwise",
                 "o": "rowwise", "down": "rowwise", "gate_up": "colwise_fused(2)", "embed": "vocab", "head": "colwise"}


def _pattern(name: str, stem: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.*.mlp.up_proj.weight`` (the name itself if it holds
    a glob character)."""
    import re

    if any(c in name for c in "*?[]"):
        return name
    return re.sub(r"^" + re.escape(stem) + r"\.\d+\.", lambda _: stem + ".*.", name, count=1)


def imported_plan_text(result, order: tuple[str, ...] | None = None) -> str:
    """The best configuration as a sharding plan in the imported model's own parameter names: the mesh of the
    configuration (pp, dp, sp = cp, tp, in ``order``), Megatron's tensor-parallel presets by role, every other
    parameter replicated, the token ids (or a block's input states) split on dp (and sp) where the exported batch
    (and sequence) divide."""
    import yaml

    from layout_prop.planner.search import DEFAULT_ORDER

    best = result.ranked[0]
    c = best.config
    model = result.model
    imp = model.imported
    sizes = {"pp": c.pp, "dp": c.dp, "sp": c.cp, "tp": c.tp}
    names = [("sp" if a == "cp" else a) for a in (order or DEFAULT_ORDER)]
    names = [a for a in names if a in sizes and (a != "pp" or c.pp > 1)]
    mesh = {"shape": [sizes[a] for a in names], "names": names}
    tp_index = names.index("tp")

    def on_tp(placement: str) -> list[str]:
        out = ["R"] * len(names)
        out[tp_index] = placement
        return out

    params: dict = {}
    left = []
    order_ = ("embed", "q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "fc", "down", "head")
    rank = {r: i for i, r in enumerate(order_)}
    for name, role in sorted(imp.roles, key=lambda nr: (rank.get(nr[1].replace("_bias", ""), len(rank)),
                                                          nr[1].endswith("_bias"))):
        pattern = _pattern(name, imp.layer_stem)
        if pattern in params:
            continue
        if role in _ROLE_PRESETS:
            params[pattern] = _ROLE_PRESETS[role]
        elif role == "qkv":
            if model.kv_heads in (None, model.heads):
                params[pattern] = "colwise_fused(3)"
            else:  # q, k and v blocks of different widths: no strided shard cuts each on its own
                left.append(name)
        elif role in ("q_bias", "k_bias", "v_bias", "gate_bias", "up_bias", "fc_bias"):
            params[pattern] = on_tp("S(0)")
        elif role == "qkv_bias" and model.kv_heads in (None, model.heads):
            params[pattern] = on_tp("_S(0,3)")
        elif role == "gate_up_bias":
            params[pattern] = on_tp("_S(0,2)")
    params["*"] = "R"
    plan: dict = {"mesh": mesh}
    comments = []
    if imp.token_input is not None:
        token, shape = imp.token_input
        entry = ["R"] * len(names)
        for axis, dim in (("dp", 0), ("sp", 1)):  # (batch, seq) token ids or (batch, seq, hidden) states
            if sizes[axis] > 1 and axis in names:
                if shape[dim] % sizes[axis] == 0:
                    entry[names.index(axis)] = f"S({dim})"
                else:
                    comments.append(f"# {token}'s dim {dim} ({shape[dim]}, as exported) does not split {sizes[axis]} "
                                    f"ways: replicated on {axis} (export with a batch of micro-batch x dp to split it)")
        if entry != ["R"] * len(names):
            plan["inputs"] = {token: entry}
    if left:
        comments.append(f"# replicated: {', '.join(left[:2])}{'...' if len(left) > 2 else ''} (fused q, k, v of "
                        "different widths)")
    if c.pp > 1:
        comments.append(f"# the pp axis ({c.pp} stages) is replicated: a sharding plan has no pipeline block "
                        "(the spec -o writes has it)")
    header = [f"# layout-prop plan --search: the best of {result.candidates:,} candidates on {result.devices:,} "
              f"devices of {result.cluster}, in the imported model's parameter names (import MODEL --plan THIS)",
              f"# configuration: {c.label()}",
              f"# predicted step {best.step_time_s * 1e3:,.3f} ms (as a gen {model.family} of the same sizes), MFU "
              f"{best.mfu:.1%}, memory per rank {int(best.memory_bytes):,} bytes",
              "# activations follow the parameters (no sequence parallelism here): check --reshard inserts the moves",
              "# " + json.dumps({"search": c.to_dict()})] + comments
    body = yaml.safe_dump(plan, sort_keys=False, default_flow_style=None) + "parameters:\n"
    for key, value in params.items():  # one line a pattern, placements in flow style
        body += (f"  {yaml.safe_dump(key, width=1000).splitlines()[0]}: "
                 f"{yaml.safe_dump(value, default_flow_style=True, width=1000).splitlines()[0]}\n")
    return "\n".join(header) + "\n" + body
