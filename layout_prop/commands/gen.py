"""``layout-prop gen llama|gpt|moe``: write the spec of a generated model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .flags import (
    MAX_LAYERS, layers_arg, non_negative_int, positive_float_arg, positive_int, probability_arg,
)

__all__ = ["add_parser", "run", "build_spec"]

#: per model, the defaults of the flags whose default depends on it
DEFAULTS = {"llama": {"mesh": "dp=2,sp=2,tp=2", "batch": 2, "ffn": 64},
            "gpt": {"mesh": "dp=2,sp=2,tp=2", "batch": 2, "ffn": None},
            "moe": {"mesh": "dp=2,ep=2,tp=2", "batch": 4, "ffn": 32}}


def _value(args, name: str):
    value = vars(args)[name]
    return DEFAULTS[args.model][name] if value is None else value


def _refuse_foreign_flags(args) -> None:
    """A flag of another model is bad usage (one line, exit 2), never silently ignored."""
    from layout_prop.core.errors import SpecError

    moe_only = ("experts", "top_k", "capacity_factor", "capacity_scope", "shared_experts", "router", "dense_layers",
                "dense_ffn")
    foreign = {"llama": ("dropout", *moe_only),
               "gpt": ("kv_heads", "context_parallel", *moe_only),  # --full and --tie-embeddings: what gpt always is
               "moe": ("dropout", "context_parallel")}[args.model]
    defaults = {"dropout": 0.1, "experts": 4, "top_k": 2, "capacity_factor": None, "capacity_scope": "global",
                "shared_experts": 0, "router": "softmax", "kv_heads": None, "full": False, "tie_embeddings": False,
                "dense_layers": 0, "dense_ffn": None, "context_parallel": "all_gather"}
    given = [f"--{name.replace('_', '-')}" for name in foreign if vars(args)[name] != defaults[name]]
    if given:
        raise SpecError("bad-usage", f"gen {args.model} does not take {', '.join(given)}",
                        hint="see layout-prop gen --help for which flags each model takes")
    if args.model == "moe" and args.capacity_scope != "global" and args.capacity_factor is None:
        raise SpecError("bad-usage", "--capacity-scope needs --capacity-factor (without one no token is dropped)",
                        hint="add --capacity-factor, e.g. 1.25, or leave --capacity-scope out")
    needs_full = not args.full and args.model != "gpt"
    if needs_full and (args.tie_embeddings or args.vocab != 64):
        flag = "--tie-embeddings" if args.tie_embeddings else "--vocab"
        raise SpecError("bad-usage", f"{flag} needs --full (gen {args.model} without it writes decoder layers only)",
                        hint=f"add --full, or leave {flag} out")


#: the training-configuration flags (their defaults): any given makes gen write the configuration blocks
CONFIG_FLAGS = {"zero": None, "recompute": None, "micro_batches": None, "micro_batch": None, "schedule": None,
                "virtual_stages": None}


def _configuration(args, mesh: list[tuple[str, int]]) -> tuple[int | None, dict]:
    """``(graph batch, blocks)`` for the training configuration the flags ask for, as ``plan --search -o`` writes
    it: ``zero: {stage, axes: [dp]}``, ``recompute: MODE``, ``pipeline: {axis: pp, micro_batches, schedule,
    virtual_stages}`` with a pp axis over 1, and ``training: {global_batch, micro_batch}`` (the global batch is
    micro-batch x dp x micro-batches); the graph batch is one micro-batch on every data-parallel rank (with a
    pipeline, its micro-batches). ``(None, {})`` when no such flag is given and the mesh has no pp axis."""
    from layout_prop.core.errors import SpecError

    sizes = dict(mesh)
    given = {k: vars(args)[k] for k in CONFIG_FLAGS}
    if all(v is None for v in given.values()) and "pp" not in sizes:
        return None, {}
    pp, dp = sizes.get("pp", 1), sizes.get("dp", 1)
    if args.model == "moe":
        dp *= sizes.get("ep", 1)  # an ep rank's sequences are data parallel outside the experts
    m = given["micro_batches"] or 1
    b = given["micro_batch"] or 1
    if pp == 1 and (given["schedule"] is not None or given["virtual_stages"] is not None):
        flag = "--schedule" if given["schedule"] is not None else "--virtual-stages"
        raise SpecError("bad-usage", f"{flag} needs a pipeline: a pp axis over 1 in --mesh",
                        hint="add pp=N to --mesh (e.g. --mesh pp=2,dp=2,tp=2), or leave the flag out")
    schedule = given["schedule"] or "1f1b"
    if schedule != "interleaved" and (given["virtual_stages"] or 1) > 1:  # never dropped without a word
        raise SpecError("bad-usage", f"--virtual-stages {given['virtual_stages']} needs --schedule interleaved "
                        f"(the {schedule} schedule runs one chunk a stage)",
                        hint="add --schedule interleaved, or leave --virtual-stages out")
    v = given["virtual_stages"] or (2 if schedule == "interleaved" else 1)
    batch = b * dp * (m if pp > 1 else 1)
    if args.batch is not None and args.batch != batch:
        raise SpecError("bad-usage", f"--batch {args.batch} is not the configuration's graph batch {batch} (micro-batch "
                        f"{b} x dp {dp}{f' x {m} micro-batches' if pp > 1 else ''})",
                        hint="leave --batch out (the configuration sets it), or give --micro-batch")
    blocks: dict = {}
    if given["zero"]:
        blocks["zero"] = {"stage": given["zero"], "axes": ["dp"]}
    if given["recompute"] not in (None, "none"):
        blocks["recompute"] = given["recompute"]
    if pp > 1:
        blocks["pipeline"] = {"axis": "pp", "micro_batches": m, "schedule": schedule,
                              "virtual_stages": v if schedule == "interleaved" else 1}
    blocks["training"] = {"global_batch": b * dp * m, "micro_batch": b * (sizes.get("ep", 1) if args.model == "moe"
                                                                           else 1)}
    return batch, blocks


def build_spec(args) -> dict:
    """The spec dict the parsed ``gen`` arguments ask for."""
    from layout_prop.frontends.generate import parse_mesh_arg

    _refuse_foreign_flags(args)
    mesh = parse_mesh_arg(_value(args, "mesh"), args.model, pipeline=True)
    batch, blocks = _configuration(args, mesh)
    spec = _model_spec(args, mesh, batch if batch is not None else _value(args, "batch"))
    spec.update(blocks)
    if blocks:
        from layout_prop.io.loader import load_spec
        from layout_prop.workflows.blocks import read_blocks

        graph = load_spec(spec)
        pipeline = read_blocks(graph).pipeline  # a block check would refuse (micro-batches the batch does not cut)
        if pipeline is not None:
            _check_chunks(args, graph, pipeline)
    return spec


def _check_chunks(args, graph, pipeline) -> None:
    """Refuse a pipeline cut into more chunks than the model has layers (``--mesh pp=4`` with ``--layers 2``), a
    spec every other command would refuse: the pipeline pass's own cut (``forward_chunks``) is asked, and its
    ``bad-pipeline`` said in gen's flags (``bad-value``, one line, exit 2)."""
    from layout_prop.core.errors import SpecError
    from layout_prop.passes.pipeline import forward_chunks

    try:
        forward_chunks(graph, pipeline)
    except SpecError as err:
        virtual = f" x {pipeline.virtual_stages} virtual stages" if pipeline.virtual_stages > 1 else ""
        raise SpecError("bad-value", f"--mesh pp={pipeline.stages}{virtual} with --layers {args.layers}: "
                        f"{err.message}", path="--layers",
                        hint=f"give --layers {pipeline.chunks} or more, or a smaller pp in --mesh") from None


def _model_spec(args, mesh, batch: int) -> dict:
    from layout_prop.frontends.generate import gpt_spec, llama_spec, moe_spec

    common = dict(batch=batch, seq=args.seq, hidden=args.hidden, heads=args.heads,
                  ffn=_value(args, "ffn"), dtype=args.dtype)
    if args.model == "gpt":
        return gpt_spec(args.layers, mesh, vocab=args.vocab, dropout=args.dropout, **common)
    if args.model == "moe":
        return moe_spec(args.layers, mesh, experts=args.experts, top_k=args.top_k,
                        capacity_factor=args.capacity_factor, capacity_scope=args.capacity_scope,
                        shared_experts=args.shared_experts, router=args.router,
                        kv_heads=args.kv_heads, full=args.full, vocab=args.vocab,
                        tie_embeddings=args.tie_embeddings, dense_layers=args.dense_layers,
                        dense_ffn=args.dense_ffn, **common)
    cp = args.context_parallel
    if not args.full and args.kv_heads is None and cp == "all_gather":
        return llama_spec(args.layers, mesh, **common)  # exactly what gen llama has always written
    return llama_spec(args.layers, mesh, kv_heads=args.kv_heads, full=args.full, vocab=args.vocab,
                      tie_embeddings=args.tie_embeddings, context_parallel=cp, **common)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop gen``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("gen", help="write the spec of a generated model")
    parser.add_argument("model", choices=["llama", "gpt", "moe"], help="the model family: Llama, GPT-3, or Llama "
                        "layers with a Mixture-of-Experts MLP")
    parser.add_argument("--layers", type=layers_arg, default=1,
                        help=f"number of decoder layers (default 1, at most {MAX_LAYERS:,})")
    parser.add_argument("--mesh", help="mesh axes and sizes (default dp=2,sp=2,tp=2; moe: dp=2,ep=2,tp=2)")
    parser.add_argument("--batch", type=positive_int, help="batch size B (default 2; moe: 4)")
    parser.add_argument("--seq", type=positive_int, default=8, help="sequence length S (default 8)")
    parser.add_argument("--hidden", type=positive_int, default=32, help="hidden size (default 32)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads; hidden / heads is the head dim "
                        "(default 4)")
    parser.add_argument("--kv-heads", type=positive_int, help="key/value heads, dividing heads (grouped-query "
                        "attention; default: heads; llama and moe)")
    parser.add_argument("--ffn", type=positive_int, help="MLP inner size (default 64; gpt: 4 x hidden; moe: 32, "
                        "each expert's)")
    parser.add_argument("--full", action="store_true", help="llama, moe: the training graph: token ids and labels in, "
                        "embedding, the layers, final norm, output head, cross-entropy loss out (gpt always is)")
    parser.add_argument("--vocab", type=positive_int, default=64, help="vocabulary size, at least 2 (default 64; "
                        "with --full, and gpt)")
    parser.add_argument("--tie-embeddings", action="store_true", help="llama --full, moe --full: the output head is "
                        "the embedding table (gpt always ties)")
    parser.add_argument("--context-parallel", choices=["all_gather", "ulysses", "auto", "ring"], default="all_gather",
                        help="llama: the attention's context_parallel over the sp axis (ring: ring attention, k and v "
                        "passed around sp by permutes; default all_gather)")
    parser.add_argument("--dropout", type=probability_arg, default=0.1, help="gpt: dropout probability (default 0.1)")
    parser.add_argument("--experts", type=positive_int, default=4, help="moe: routed experts E (default 4)")
    parser.add_argument("--top-k", type=positive_int, default=2, help="moe: experts per token, at most E (default 2)")
    parser.add_argument("--capacity-factor", type=positive_float_arg, help="moe: expert capacity, ceil(factor x tokens "
                        "x top-k / E) over the global token count, tokens past it dropped in token order (default: "
                        "none, no token dropped)")
    parser.add_argument("--capacity-scope", choices=["global", "group"], default="global", help="moe: where the "
                        "capacity counts: over all tokens, dropped in global token order (default), or per token shard "
                        "(Megatron's drop-and-pad: a buffer of about factor x tokens x top-k slots)")
    parser.add_argument("--shared-experts", type=non_negative_int, default=0, help="moe: always-on SwiGLU experts "
                        "beside the routed ones (default 0)")
    parser.add_argument("--router", choices=["softmax", "sigmoid"], default="softmax", help="moe: router scores, "
                        "softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3); the top-k renormalised (default softmax)")
    parser.add_argument("--dense-layers", type=non_negative_int, default=0, help="moe: the first N layers have a dense "
                        "SwiGLU MLP instead of experts, as DeepSeek-V3's first 3 (default 0)")
    parser.add_argument("--dense-ffn", type=positive_int, help="moe: the dense layers' MLP inner size (default --ffn)")
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="the training configuration, written as plan "
                        "--search -o writes it: ZeRO stage over dp (a zero: block)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], help="recomputation (a recompute: block)")
    parser.add_argument("--micro-batches", type=positive_int, help="micro-batches a step: the pipeline's with a pp axis "
                        "in --mesh, else gradient accumulation (the training: block's global batch)")
    parser.add_argument("--micro-batch", type=positive_int, help="sequences of one micro-batch on one data-parallel rank "
                        "(default 1 with a configuration flag; the graph batch is micro-batch x dp, x micro-batches with pp)")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], help="the pipeline schedule (needs pp in "
                        "--mesh; default 1f1b)")
    parser.add_argument("--virtual-stages", type=positive_int, help="interleaved: chunks a stage (default 2; "
                        "needs --schedule interleaved)")
    parser.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (activations "
                        "outside the tensor-parallel regions cut on S by tp): what gen always writes, said explicitly")
    parser.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"],
                        help="dtype of every float tensor (default float32; RoPE, softmax and the norms need floats)")
    parser.add_argument("-o", "--output", type=Path, help="write to this file (.yaml or .json); default stdout")
    return parser


def run(args) -> int:
    from layout_prop.core.errors import SpecError
    from layout_prop.io.loader import MAX_SPEC_BYTES, format_spec, load_spec

    if args.output is not None:
        from layout_prop.io.output import check_output

        check_output(args.output)  # a folder, a missing folder, /dev/full: said before the model is built
    spec = build_spec(args)
    load_spec(spec)  # never write a spec that check would refuse
    text = format_spec(spec, args.output)
    size = len(text.encode())
    if size > MAX_SPEC_BYTES:  # MoE layers are larger than Llama's, which the --layers limit is set for
        raise SpecError("too-large", f"the spec of {args.layers:,} layers would be {size:,} bytes, over the "
                        f"{MAX_SPEC_BYTES:,} bytes a spec may have", hint="generate fewer layers")
    if args.output is None:
        print(text, end="")
    else:
        from layout_prop.io.output import is_stdout, write_output

        write_output(args.output, text)  # atomic: a full disk leaves no truncated spec; -o -: stdout
        if not is_stdout(args.output):
            print(f"wrote {args.output} ({len(spec['nodes'])} nodes)", file=sys.stderr)
    return 0
