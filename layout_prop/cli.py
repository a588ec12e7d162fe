"""The ``layout-prop`` command line.

Exit codes: 0 ok; 1 when the answer is no (violations in check, run, lower and plan, a
numerical mismatch in run, a wrong op in verify; viz and explain exit 0 once their output
is written); 2 unusable input (a bad spec, an unknown op, a bad flag) with one line on
stderr and never a traceback; 141 (as a Unix tool killed by SIGPIPE) and no message when
the reader of stdout goes away.
Everything printed goes through :func:`layout_prop.core.errors.printable`: control characters
from a spec are escaped, never written raw to the terminal.
"""

from __future__ import annotations

import argparse
import errno
import gc
import io
import os
import sys
from pathlib import Path
from typing import Sequence

from . import __version__
from .core.errors import CUT_LENGTH, LayoutPropError, cut, describe, printable
from .io.output import OutputFailed

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line, with the closest known flag, and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = _choice_suggestion(message) or f"see {self.prog} --help"
        if len(message) > CUT_LENGTH:  # argparse quotes the whole bad argument: its middle goes
            keep = (CUT_LENGTH - 5) // 2
            message = message[:keep] + " ... " + message[-keep:]
        print(printable(f"layout-prop: error: bad-usage: {message} (hint: {hint})"), file=sys.stderr)
        raise SystemExit(2)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command_parser(getattr(ns, "command", None))
            close = _closest_flag(command, extras[0])
            hint = f"did you mean {close}?" if close else f"see {command.prog} --help"
            words = " ".join(extras)
            if len(words) > CUT_LENGTH:
                words = words[:CUT_LENGTH - 3] + "..."
            print(printable(f"layout-prop: error: bad-usage: unrecognized arguments: {words} "
                            f"(hint: {hint})"), file=sys.stderr)
            raise SystemExit(2)
        return ns

    def _command_parser(self, command: str | None) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return self


def _closest_flag(parser: argparse.ArgumentParser, word: str) -> str | None:
    """The flag of ``parser`` closest to the unknown ``word`` (``--reshrad`` -> ``--reshard``)."""
    import difflib

    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        return None
    flags = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
    return close[0] if close else None


def _choice_suggestion(message: str) -> str | None:
    """For argparse's ``invalid choice: 'chek' (choose from ...)``, the closest choice."""
    import difflib
    import re

    m = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not m:
        return None
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    close = difflib.get_close_matches(m.group(1), choices, n=1)
    return f"did you mean {close[0]!r}?" if close else None


RUNS_CODE = ("Ops come from Python code: `verify --module FILE` imports FILE, and every command imports the "
             "installed packages that declare a `layout_prop.ops` entry point; that code runs with your "
             "permissions, so give only files and packages you trust.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="layout-prop", description="Layout propagation, checking, resharding and SPMD execution "
                "for sharded tensor graphs.", epilog=RUNS_CODE)
    p.add_argument("--version", action="version", version=f"layout-prop {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser("check", help="propagate layouts and report every layout and violation")
    c.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    c.add_argument("--reshard", action="store_true", help="insert the cheapest redistributions that fix violations")
    c.add_argument("--backward", action="store_true", help="also build the gradient graph (grad:NAME values)")
    c.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default="numpy",
                   help="the kernel backend whose constraints to check (default numpy)")
    c.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                   help="count the optimizer's states in memory per rank (adam: 2 per parameter; default none, as "
                        "sgd)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    _add_model_args(c)

    r = sub.add_parser("run", help="lower, execute every rank, and compare with one device")
    r.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    r.add_argument("--engine", choices=["sim", "mindspore"], default="sim", help="execution engine (default sim)")
    r.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default=None,
                   help="kernel backend (default: numpy on sim, mindspore on the mindspore engine)")
    r.add_argument("--backward", action="store_true", help="also run the backward and compare gradients")
    r.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the random inputs (default 0)")
    r.add_argument("--no-reshard", action="store_true", help="refuse (exit 1) instead of inserting redistributions")
    r.add_argument("--timeout", type=_seconds, default=None,
                   help="mindspore engine: seconds before giving up (default 300, at most a week)")
    r.add_argument("--keep-logs", action="store_true",
                   help="mindspore engine: keep the run folder (worker logs) after a successful run too")
    r.add_argument("--nodes", type=_count_arg, default=1,
                   help="mindspore engine: machines the run spans (default 1)")
    r.add_argument("--node-rank", type=_node_rank_arg, default=0,
                   help="mindspore engine: this machine's node (default 0)")
    r.add_argument("--master-addr", metavar="HOST", help="mindspore engine: host of msrun's scheduler (--nodes)")
    r.add_argument("--master-port", type=_positive_int, metavar="P",
                   help="mindspore engine: its port (1024-65535; default a free one on one machine, msrun's 8118 "
                        "across machines)")
    r.add_argument("--local-workers", type=_count_arg, metavar="W",
                   help="mindspore engine: workers a node (default the mesh's ranks over --nodes)")
    r.add_argument("--emulate-nodes", type=_count_arg, metavar="N",
                   help="mindspore engine: run N nodes on this machine, each through its own msrun (for tests)")
    r.add_argument("--rtol", type=_tolerance, default=None,
                   help="relative tolerance (default by dtype: float64 1e-12, float32 1e-5, float16 1e-2, bfloat16 "
                        "8e-2)")
    r.add_argument("--inputs", type=Path, default=None, metavar="FILE.npz",
                   help="global arrays of some or all graph inputs, keyed by input name (numpy.savez; no pickles); "
                        "the others are drawn at random, or with MODEL --plan PLAN are the model's own weights")
    from .io.sizes import GRAMMAR as SIZE_GRAMMAR  # --max-memory's grammar, the same as plan --memory-per-rank's

    r.add_argument("--max-memory", type=_memory_size, default=None, metavar="SIZE",
                   help="refuse a run whose estimated memory exceeds SIZE (like 4096, 512M, 8GB, 1.5TiB; default: "
                        f"the memory available now); {SIZE_GRAMMAR}")
    r.add_argument("--max-time", type=_seconds, default=None, metavar="SECONDS",
                   help="refuse a run on the simulator estimated to take longer than SECONDS (default 300, at most "
                        "a week); the estimate counts elements, bytes and ranks")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    _add_model_args(r)

    sub.add_parser("demo", help="analyse and simulate a built-in example (no files needed; writes "
                   "./layout-prop-demo.html)")

    ex = sub.add_parser("explain", help="why a value has its layout: the chain of rules back to the inputs",
                        description="Why a value has its layout: the chain of rules back to the declared inputs, "
                                    "with the violations on the way. Exits 0 once the explanation is printed, "
                                    "violations or not (check exits 1 on them).")
    ex.add_argument("spec", metavar="SPEC", type=Path, help="a YAML or JSON spec file (- reads standard input)")
    ex.add_argument("value", metavar="NAME", help="a value name (node, node:i, an input, or grad:INPUT)")
    ex.add_argument("--reshard", action="store_true", help="explain the resharded graph")
    ex.add_argument("--backward", action="store_true", help="include the gradient graph")
    ex.add_argument("--json", action="store_true", help="print the derivation as JSON")
    from .commands.explain import DEFAULT_DEPTH, MAX_DEPTH

    ex.add_argument("--depth", type=_positive_int, default=DEFAULT_DEPTH, metavar="N",
                    help=f"producers to walk back, at most {MAX_DEPTH} (default {DEFAULT_DEPTH}); a value further "
                         "up is marked, to be explained on its own")
    _add_model_args(ex)

    ve = sub.add_parser("verify", help="check an op's transfer function on every placement combination",
                        epilog=RUNS_CODE)
    ve.add_argument("op", metavar="OP", help="a built-in op or one registered by --module")
    ve.add_argument("--module", type=Path,
                    help="a Python file that registers the op (rule and numpy kernel); it is imported, so its "
                         "code RUNS with your permissions: give only a file you trust")
    ve.add_argument("--mesh", action="append", type=_mesh_arg, metavar="AxB",
                    help="a mesh shape such as 2x2 (repeatable; default 2 and 2x2)")
    ve.add_argument("--backward", action="store_true", help="also compare gradients")
    ve.add_argument("--samples", type=_samples_arg, default="all",
                    help="placement combinations per sample and mesh: 'all' (default) or a number (seeded)")
    ve.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the sampling and the data (default 0)")
    ve.add_argument("--jobs", type=_jobs_arg, default=1,
                    help=f"processes to check combinations in (default 1, at most {MAX_JOBS}; the counts are the same)")
    ve.add_argument("--json", action="store_true", help="print one JSON object")

    au = sub.add_parser("audit", help="judge a hyper-parallel checkout's sharding rules by execution",
                        epilog=RUNS_CODE)
    au.add_argument("path", metavar="PATH", type=Path,
                    help="a hyper-parallel checkout (the folder holding hyper_parallel/); its package is imported, "
                         "so its code RUNS with your permissions")
    au.add_argument("--op", action="append", metavar="NAME", help="an upstream op name (repeatable; default all)")
    au.add_argument("--module", type=Path, action="append", metavar="FILE",
                    help="a Python file defining DistributedOp subclasses that register more ops (repeatable; "
                         "imported after the checkout, its code RUNS)")
    au.add_argument("--platform", action="store_true",
                    help="import the checkout's package with its own platform layer (MindSpore or torch) instead of "
                         "layout-prop's stand-in")
    au.add_argument("--mesh", action="append", type=_mesh_arg, metavar="AxB",
                    help="a mesh shape such as 4 or 2x2 (repeatable; default 4 and 2x2)")
    au.add_argument("--samples", type=_positive_int, default=256, metavar="N",
                    help="input combinations per case and mesh, a seeded sample beyond N (default 256)")
    au.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the sampling and the data (default 0)")
    au.add_argument("--time-limit", type=_time_limit_arg, default=10.0, metavar="SECONDS",
                    help="wall time one call of the checkout's code may take in the audit's worker (default 10)")
    au_out = au.add_mutually_exclusive_group()
    au_out.add_argument("--json", action="store_true", help="print one JSON object")
    au_out.add_argument("--markdown", action="store_true", help="print the per-op table as docs/audit.md shows it")

    _add_model_args(_add_viz_parser(sub))
    _add_import_parser(sub)


    _add_plan_parser(sub)

    ge = sub.add_parser("gen", help="write the spec of a generated model")
    ge.add_argument("model", choices=["llama", "gpt", "moe"], help="the model family: Llama, GPT-3, or Llama "
                    "layers with a Mixture-of-Experts MLP")
    ge.add_argument("--layers", type=_layers_arg, default=1,
                    help=f"number of decoder layers (default 1, at most {MAX_LAYERS:,})")
    ge.add_argument("--mesh", help="mesh axes and sizes (default dp=2,sp=2,tp=2; moe: dp=2,ep=2,tp=2)")
    ge.add_argument("--batch", type=_positive_int, help="batch size B (default 2; moe: 4)")
    ge.add_argument("--seq", type=_positive_int, default=8, help="sequence length S (default 8)")
    ge.add_argument("--hidden", type=_positive_int, default=32, help="hidden size (default 32)")
    ge.add_argument("--heads", type=_positive_int, default=4, help="attention heads; hidden / heads is the head dim "
                    "(default 4)")
    ge.add_argument("--kv-heads", type=_positive_int, help="key/value heads, dividing heads (grouped-query "
                    "attention; default: heads; llama and moe)")
    ge.add_argument("--ffn", type=_positive_int, help="MLP inner size (default 64; gpt: 4 x hidden; moe: 32, "
                    "each expert's)")
    ge.add_argument("--full", action="store_true", help="llama, moe: the training graph: token ids and labels in, "
                    "embedding, the layers, final norm, output head, cross-entropy loss out (gpt always is)")
    ge.add_argument("--vocab", type=_positive_int, default=64, help="vocabulary size, at least 2 (default 64; "
                    "with --full, and gpt)")
    ge.add_argument("--tie-embeddings", action="store_true", help="llama --full, moe --full: the output head is "
                    "the embedding table (gpt always ties)")
    ge.add_argument("--context-parallel", choices=["all_gather", "ulysses", "auto", "ring"], default="all_gather",
                    help="llama: the attention's context_parallel over the sp axis (ring: ring attention, k and v "
                    "passed around sp by permutes; default all_gather)")
    ge.add_argument("--dropout", type=_probability_arg, default=0.1, help="gpt: dropout probability (default 0.1)")
    ge.add_argument("--experts", type=_positive_int, default=4, help="moe: routed experts E (default 4)")
    ge.add_argument("--top-k", type=_positive_int, default=2, help="moe: experts per token, at most E (default 2)")
    ge.add_argument("--capacity-factor", type=_positive_float_arg, help="moe: expert capacity, ceil(factor x tokens "
                    "x top-k / E) over the global token count, tokens past it dropped in token order (default: "
                    "none, no token dropped)")
    ge.add_argument("--capacity-scope", choices=["global", "group"], default="global", help="moe: where the "
                    "capacity counts: over all tokens, dropped in global token order (default), or per token shard "
                    "(Megatron's drop-and-pad: a buffer of about factor x tokens x top-k slots)")
    ge.add_argument("--shared-experts", type=_non_negative_int, default=0, help="moe: always-on SwiGLU experts "
                    "beside the routed ones (default 0)")
    ge.add_argument("--router", choices=["softmax", "sigmoid"], default="softmax", help="moe: router scores, "
                    "softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3); the top-k renormalised (default softmax)")
    ge.add_argument("--dense-layers", type=_non_negative_int, default=0, help="moe: the first N layers have a dense "
                    "SwiGLU MLP instead of experts, as DeepSeek-V3's first 3 (default 0)")
    ge.add_argument("--dense-ffn", type=_positive_int, help="moe: the dense layers' MLP inner size (default --ffn)")
    ge.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="the training configuration, written as plan "
                    "--search -o writes it: ZeRO stage over dp (a zero: block)")
    ge.add_argument("--recompute", choices=["none", "selective", "full"], help="recomputation (a recompute: block)")
    ge.add_argument("--micro-batches", type=_positive_int, help="micro-batches a step: the pipeline's with a pp axis "
                    "in --mesh, else gradient accumulation (the training: block's global batch)")
    ge.add_argument("--micro-batch", type=_positive_int, help="sequences of one micro-batch on one data-parallel rank "
                    "(default 1 with a configuration flag; the graph batch is micro-batch x dp, x micro-batches with pp)")
    ge.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], help="the pipeline schedule (needs pp in "
                    "--mesh; default 1f1b)")
    ge.add_argument("--virtual-stages", type=_positive_int, help="interleaved: chunks a stage (default 2)")
    ge.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (activations "
                    "outside the tensor-parallel regions cut on S by tp): what gen always writes, said explicitly")
    ge.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"],
                    help="dtype of every float tensor (default float32; RoPE, softmax and the norms need floats)")
    ge.add_argument("-o", "--output", type=Path, help="write to this file (.yaml or .json); default stdout")

    es = sub.add_parser("estimate", help="a training step's modelled time on a cluster: compute, exposed "
                        "communication, optimizer, MFU, memory")
    es.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file, or a model with --plan (- reads stdin)")
    es.add_argument("--cluster", required=True, metavar="NAME|FILE",
                    help="a built-in profile (a100-80g, h100-80g, ascend-910b) or a cluster YAML file")
    es.add_argument("--global-batch", type=_positive_int, metavar="N", help="sequences a step (with --micro-batch)")
    es.add_argument("--micro-batch", type=_positive_int, metavar="M",
                    help="sequences a micro-batch on one data-parallel rank; accumulation is N / (M x dp)")
    es.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                    help="full: recompute every activation in the backward (one more forward); selective: the "
                    "attention core (default: the spec's recompute block, else none)")
    es.add_argument("--recompute-layers", metavar="L0,L1", help="recompute only these layers (full unless "
                    "--recompute selective)")
    es.add_argument("--zero", type=_non_negative_int, choices=[0, 1, 2, 3], metavar="STAGE", help="ZeRO stage 0-3 over every "
                    "data-parallel mesh axis (dp, data, fsdp; default: the spec's zero block, else 0)")
    es.add_argument("--no-overlap", action="store_true",
                    help="expose the whole gradient synchronisation (default: overlapped with the backward)")
    es.add_argument("--json", action="store_true", help="print JSON")
    _add_model_args(es)

    pl = sub.add_parser("pipeline", help="a spec's pipeline stages, schedule, bubble and moves; one rank's program; "
                        "--run executes it and compares with one device")
    pl.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec with a pipeline: block (- reads standard input)")
    pl.add_argument("--rank", type=_non_negative_int, metavar="R",
                    help="print rank R's program: its stage, schedule, the values it receives, its local ops")
    pl.add_argument("--run", action="store_true", help="execute every rank's schedule over the micro-batches and "
                    "compare the loss and gradients with one device on the whole batch (exit 1 if they differ)")
    pl.add_argument("--engine", choices=["sim", "mindspore"], default="sim",
                    help="with --run: the simulator (default) or msrun workers (numpy kernels)")
    pl.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the random inputs (default 0)")
    pl.add_argument("--timeout", type=_seconds, default=300.0,
                    help="--engine mindspore: seconds before giving up (default 300)")
    pl.add_argument("--cluster", default="a100-80g", metavar="NAME|FILE",
                    help="the device whose op times balance stages the spec does not cut (default a100-80g)")
    pl.add_argument("--json", action="store_true", help="print JSON")

    xp = sub.add_parser("export", help="write the checked plan for hyper-parallel, MindSpore or torch (code to paste, "
                        "and the plan as data)")
    xp.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (plan's output too), or a model with --plan")
    xp.add_argument("--to", required=True, choices=["hyper-parallel", "mindspore", "torch"], help="the target framework")
    xp.add_argument("-o", "--output", type=Path, help="write the Python module to this file; default stdout")
    xp.add_argument("--data", type=Path, metavar="FILE", help="also write the plan as data (.yaml or .json), a "
                    "sharding plan that import --plan reads")
    xp.add_argument("--input", action="append", metavar="NAME", help="a graph input that is a model input, not a "
                    "parameter (repeatable; default: a model's own inputs, none for a spec)")
    _add_model_args(xp)

    op = sub.add_parser("ops", help="the op reference: every op, or one op in full (generated from the registry)")
    op.add_argument("name", metavar="NAME", nargs="?", help="an op name or alias: print that op in full")
    op.add_argument("--json", action="store_true", help="print JSON (a list of ops, or one op)")
    op.add_argument("--markdown", action="store_true", help="print the built-in ops as docs/ops.md is written")

    lo = sub.add_parser("lower", help="print one rank's local subgraph")
    lo.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    lo.add_argument("--rank", type=_integer, required=True, help="the rank to print")
    lo.add_argument("--backward", action="store_true", help="lower the joint forward and backward graph")
    lo.add_argument("--no-reshard", action="store_true", help="refuse (exit 1) instead of inserting redistributions")
    lo.add_argument("--json", action="store_true", help="print the rank's subgraph as JSON")
    _add_model_args(lo)
    return p


def _add_viz_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``viz`` subcommand (``layout-prop viz SPEC -o FILE``) to an argparse subparsers object."""
    viz = subparsers.add_parser(
        "viz", help="draw the graph (or one tensor's sharding grid) as HTML, SVG, PNG or DOT",
        description="Draw the propagated graph: layers left to right, placements and local shapes on the edges, "
                    "redistributions with their steps and bytes, violations in red. With --tensor, draw which "
                    "ranks hold which block of one value instead. Exits 0 once the file is written, violations or not "
                    "(check exits 1 on them).")
    viz.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    viz.add_argument("-o", "--output", required=True, metavar="FILE",
                     help="the picture to write; its extension picks the format: .html (interactive, "
                          "self-contained), .svg, .png (needs matplotlib) or .dot (Graphviz text)")
    viz.add_argument("--reshard", action="store_true", help="draw the graph with the redistributions reshard inserts")
    viz.add_argument("--backward", action="store_true", help="also draw the gradient graph (grad:NAME values)")
    viz.add_argument("--tensor", metavar="NAME",
                     help="draw one value's sharding grid instead: an input, a node output (name:i), or grad:NAME "
                          "with --backward")
    viz.add_argument("--dims", metavar="D0,D1",
                     help="with --tensor: the dims drawn as rows and columns (default: the sharded ones); write a "
                          "list that starts with a negative dim as --dims=-1,0")
    return viz


def _add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--plan`` and ``--opaque``, for a command whose SPEC may also be a model file."""
    parser.add_argument("--plan", metavar="PLAN", help="with a model (.onnx or .mindir) instead of a spec: its "
                        "sharding plan (YAML or JSON)")
    parser.add_argument("--opaque", action="store_true",
                        help="with a model: treat ops the importer cannot map as barriers instead of refusing")
    return parser


def _add_import_parser(sub) -> argparse.ArgumentParser:
    im = sub.add_parser("import", help="import an ONNX or MindIR model with a sharding plan; write an ordinary spec")
    im.add_argument("model", metavar="MODEL", help="an .onnx or .mindir file")
    im.add_argument("--plan", metavar="PLAN", help="the sharding plan (YAML or JSON); without it, list the parameters "
                    "a plan may name (name, shape, consumer, suggested preset) and, with -o, write a plan skeleton")
    im.add_argument("-o", "--output", type=Path, help="write the spec to this file (.yaml or .json; without --plan, "
                    "the plan skeleton); default stdout")
    im.add_argument("--opaque", action="store_true",
                    help="treat ops the importer cannot map as barriers instead of refusing the model")
    im.add_argument("--no-fuse", action="store_true",
                    help="do not fuse decomposed patterns (RMSNorm, RoPE, SiLU, attention) into registry ops")
    return im


def _add_plan_parser(sub) -> None:
    """Register ``layout-prop plan`` on the CLI's subparsers."""
    from .io.sizes import GRAMMAR as SIZE_GRAMMAR

    p = sub.add_parser("plan", help="choose every auto layout with the least communication per training step")
    p.add_argument("spec", metavar="SPEC_OR_MODEL", type=Path,
                   help="a YAML or JSON spec with placements: auto inputs, or a model (.onnx, .mindir) with --plan")
    p.add_argument("--memory-per-rank", metavar="SIZE", help="the memory limit per rank, like 16GiB, 512M or 2GB "
                   f"(default none); {SIZE_GRAMMAR}")
    p.add_argument("--objective", choices=["bytes", "time"], default=None,
                   help="minimise bytes per rank per step (the default without --cluster) or modelled time: with "
                   "--cluster the training step's (compute and collectives; the default with it), else the "
                   "redistributions' with the mesh's links")
    p.add_argument("--cluster", metavar="NAME|FILE", help="price the step on this cluster profile (a100-80g, "
                   "h100-80g, ascend-910b, or a cluster YAML file), as layout-prop estimate does")
    p.add_argument("--time-limit", metavar="SECONDS", type=_time_limit_arg, default=None,
                   help="seconds the whole command may take: building the model, the solves, the memory ladder "
                   "(default 60; up to 86400)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default=None,
                   help="count the optimizer's states in memory (adam: 2 per parameter; default none, as sgd)")
    p.add_argument("--forward-only", action="store_true", help="plan for inference: the forward's moves only")
    p.add_argument("--baseline", metavar="SPEC", type=Path, help="compare with this spec's layouts (default: SPEC's own)")
    p.add_argument("-o", "--output", type=Path, help="write the planned spec here (.yaml or .json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_model_args(p)  # a model with its sharding plan (parameters: auto for the ones to choose)
    # plan --search: the whole parallel configuration (layout_prop/commands/search.py)
    p.add_argument("--search", action="store_true", help="search dp, tp, cp, ep, pp, ZeRO, recomputation, schedule "
                   "and micro-batch, ranked by predicted step time (needs --cluster, --devices, --global-batch)")
    p.add_argument("--devices", metavar="N", type=_positive_int, help="with --search: the devices to use")
    p.add_argument("--global-batch", metavar="B", type=_positive_int, help="with --search: sequences a step")
    p.add_argument("--top", metavar="K", type=_positive_int, default=5, help="with --search: candidates shown (5)")
    p.add_argument("--plan-out", metavar="FILE", type=Path, help="with --search: write the best as a sharding plan")
    p.add_argument("--axis-order", metavar="AXES", help="with --search: mesh axes outermost first, the last filling "
                   "a node first (default pp,dp,ep,cp,tp)")
    p.add_argument("--axes", metavar="AXIS=N,...", help="with --search: degrees kept fixed, like tp=8,pp=8")


def _ascii_int(text: str) -> int:
    """``int(text)`` for ASCII digits after an optional minus, else ``ValueError``: ``int`` alone also takes
    other scripts' digits (``'١٢'`` is 12), underscores (``'1_000'``), a plus and surrounding blanks.

    >>> _ascii_int("512"), _ascii_int("-1")
    (512, -1)
    >>> _ascii_int("1_000")
    Traceback (most recent call last):
    ValueError: '1_000' is not written in ASCII digits
    """
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"{text!r} is not written in ASCII digits")
    return int(text)


def _ascii_float(text: str) -> float:
    """``float(text)`` for ASCII text without blanks or underscores, else ``ValueError``: ``float`` alone
    also takes other scripts' digits (``'٢'`` is 2.0), underscores (``'1_0'``) and surrounding blanks.

    >>> _ascii_float("0.5"), _ascii_float("1e-3")
    (0.5, 0.001)
    >>> _ascii_float("٢")
    Traceback (most recent call last):
    ValueError: '٢' is not a number in ASCII characters
    """
    if not text.isascii() or "_" in text or text != text.strip():
        raise ValueError(f"{text!r} is not a number in ASCII characters")
    return float(text)


def _integer(text: str) -> int:
    """An integer flag's value (``lower --rank``: the command says which are ranks), in ASCII digits."""
    try:
        return _ascii_int(text)
    except ValueError:  # also more than 4,300 digits
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not an integer") from None


def _non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _bounded_int(text: str, low: int, high: int, what: str) -> int:
    value = _non_negative_int(text)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{cut(value, 60)} is not {what} in {low}..{high}")
    return value


def _count_arg(text: str) -> int:
    """--nodes, --local-workers, --emulate-nodes: at least 1, at most a mesh's ranks."""
    from .core.mesh import MAX_RANKS

    return _bounded_int(text, 1, MAX_RANKS, "a count")


def _node_rank_arg(text: str) -> int:
    from .core.mesh import MAX_RANKS

    return _bounded_int(text, 0, MAX_RANKS - 1, "a node rank")


#: the most processes ``verify --jobs`` starts
MAX_JOBS = 256


def _jobs_arg(text: str) -> int:
    return _bounded_int(text, 1, MAX_JOBS, "a number of processes")


#: the most layers ``gen`` writes (about 230,000 nodes, 30 s; the spec stays under the loader's 64 MiB as JSON)
MAX_LAYERS = 10_000


def _layers_arg(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_LAYERS:
        raise argparse.ArgumentTypeError(f"{value} layers is over the limit {MAX_LAYERS:,}")
    return value


def _finite_float(text: str) -> float:
    import math

    try:
        value = _ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a finite number")
    return value


def _time_limit_arg(text: str) -> float:
    """plan --time-limit: seconds in (0, 86400]."""
    value = _finite_float(text)
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 86400] seconds")
    return value


def _positive_float_arg(text: str) -> float:
    """gen --capacity-factor: a number > 0."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def _probability_arg(text: str) -> float:
    """gen --dropout: a probability in [0, 1)."""
    value = _finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return value


def _seconds(text: str) -> float:
    try:
        value = _ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a number of seconds") from None
    if not 0 < value <= 7 * 24 * 3600:  # nan and inf fail too
        raise argparse.ArgumentTypeError(f"{cut(text, 60)[1:-1]} is not a number of seconds in (0, 604800]")
    return value


def _tolerance(text: str) -> float:
    try:
        value = _ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{cut(text, 60)} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{cut(text, 60)[1:-1]} is not a finite number >= 0")
    return value


def _memory_size(text: str) -> int:
    """``run --max-memory``: ``4096``, ``512M``, ``8G``, ``1.5TiB``, ``3MB`` -> bytes, in the one
    size grammar of :mod:`layout_prop.io.sizes` (the same as ``plan --memory-per-rank``); refused
    with ``bad-usage``, the grammar as the hint."""
    from .io.sizes import parse_size

    return parse_size(text, code="bad-usage", label="argument --max-memory: size")


def _mesh_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(_ascii_int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not like 2x2") from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"mesh {text!r} needs positive sizes")
    return shape


def _samples_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        n = _ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"samples must be 'all' or a number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError("samples must be at least 1")
    return n


#: each command's module in :mod:`layout_prop.commands` (imported only when the command runs);
#: each has ``run(args) -> exit code``
COMMANDS = {"check": "check", "run": "run", "demo": "demo", "explain": "explain", "verify": "verify", "viz": "viz",
            "import": "import_model", "plan": "plan", "gen": "gen", "ops": "ops", "lower": "lower",
            "estimate": "estimate", "audit": "audit", "export": "export", "pipeline": "pipeline"}


#: exit status when the reader of stdout went away (128 + SIGPIPE, as a Unix tool killed by it)
EXIT_BROKEN_PIPE = 141

#: the collector's thresholds while a command runs (Python's default is (700, 10, 10))
GC_THRESHOLD = (50_000, 20, 20)
#: commands that analyse one graph and end: they run without the cyclic collector (their
#: objects live until the process exits and form no cycles worth collecting; the collector
#: only walked them, 1.5 to 2 us a node of a 10,000-node check).  The rest (run, plan,
#: verify, demo: many graphs or arrays, minutes long) collect with GC_THRESHOLD.
UNCOLLECTED_COMMANDS = frozenset({"check", "explain", "lower", "viz", "gen", "import", "ops", "estimate"})


#: writing stdout or stderr (or a pipe given with -o) failed: see :class:`layout_prop.io.output.OutputFailed`
_OutputFailed = OutputFailed


class _Printable:
    """A text stream that escapes control characters (:func:`printable`, line breaks kept);
    it drops the text when the process has no such stream (started with it closed).

    When the stream is unbuffered (``python -u``, ``PYTHONUNBUFFERED=1``), its text wrapper
    writes straight to the file and ignores a short write: a pipe whose reader leaves
    while a large output is written would take part of it and report success, and the
    rest would be lost with exit 0.  The text is then written to the file here, until
    every byte is taken or the write fails."""

    def __init__(self, stream) -> None:
        self._stream = stream
        buffer = getattr(stream, "buffer", None)
        self._raw = buffer if isinstance(buffer, io.RawIOBase) else None

    @property
    def unescaped_stream(self):
        """The stream itself, for a progress line that escapes its own text but draws with ``\\r``."""
        return self._stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            out = printable(text, newlines=True)
            try:
                if self._raw is None:
                    self._stream.write(out)
                else:
                    self._stream.flush()
                    if os.linesep != "\n":
                        out = out.replace("\n", os.linesep)
                    _write_fully(self._raw, out.encode(self._stream.encoding or "utf-8", self._stream.errors or "strict"))
            except OSError as exc:
                raise _OutputFailed(exc) from None
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except OSError as exc:
                raise _OutputFailed(exc) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


#: the longest error line printed: a message that quotes a long value is cut in its middle
MAX_ERROR_LINE = 1000


def _write_fully(raw: io.RawIOBase, data: bytes) -> None:
    """Write every byte of ``data`` to an unbuffered file, however many writes it takes."""
    view = memoryview(data)
    while view:
        written = raw.write(view)
        if written is None:  # a non-blocking file that is full for now: wait until it takes more
            import select

            select.select([], [raw.fileno()], [])
            continue
        if written <= 0:
            raise OSError(errno.EIO, "the output took no bytes")
        view = view[written:]


def _error_text(err: LayoutPropError) -> str:
    """``layout-prop: error: CODE at WHERE: MESSAGE (hint: HINT)`` on one line of at most
    :data:`MAX_ERROR_LINE` characters (a rule's message may quote a whole long value)."""
    text = printable(f"layout-prop: error: {err}")
    if len(text) <= MAX_ERROR_LINE:
        return text
    where = err.where()
    head = printable(f"layout-prop: error: {err.code} at {where}: " if where else f"layout-prop: error: {err.code}: ")
    hint = printable(f" (hint: {err.hint})") if err.hint else ""
    head, hint = head[:300], hint[:300]
    room = max(MAX_ERROR_LINE - len(head) - len(hint), 40)
    message = printable(err.message)
    if len(message) > room:
        keep = (room - 5) // 2
        message = message[:keep] + " ... " + message[-keep:]
    return head + message + hint


def _error_line(code: str, message: str, hint: str) -> None:
    print(printable(f"layout-prop: error: {code}: {message} (hint: {hint})"), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    global _HARD_EXIT
    stdout, stderr = sys.stdout, sys.stderr
    threshold, collecting = gc.get_threshold(), gc.isenabled()
    # A command builds graphs of 10^4 to 10^5 objects that live until it ends; with Python's
    # default thresholds the collector walks them again and again (check of a 10,000-node spec
    # 1.5 to 2 times slower).  Collect rarely (cycles are still freed), or not at all in the
    # commands that analyse one graph and end (UNCOLLECTED_COMMANDS).
    gc.set_threshold(*GC_THRESHOLD)
    # a process started with stdout or stderr closed has None there: write to /dev/null instead
    sys.stdout = _Printable(stdout if stdout is not None else open(os.devnull, "w"))
    sys.stderr = _Printable(stderr if stderr is not None else open(os.devnull, "w"))
    try:
        parsed = _guarded("layout-prop", lambda: _parse(argv))
        if not isinstance(parsed, int) and parsed.command in UNCOLLECTED_COMMANDS:
            gc.disable()
        if _HARD_EXIT is not None and not isinstance(parsed, int):
            _HARD_EXIT = parsed.command in HARD_EXIT_COMMANDS and not getattr(parsed, "module", None)
        code = parsed if isinstance(parsed, int) else _run(parsed)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not after main returned
        return code
    except _OutputFailed as failed:  # stdout closed by its reader (| head), on a full disk (> /dev/full), or gone
        exc = failed.error
        _silence(stdout)
        if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
            return EXIT_BROKEN_PIPE  # quietly, as Unix tools do
        try:
            _error_line("write-failed", f"cannot write the output: {exc.strerror or exc}",
                        "check the disk or the file stdout goes to")
        except (OSError, _OutputFailed):  # stderr is gone too: nothing left to tell
            _silence(stderr)
        return 2
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        gc.set_threshold(*threshold)
        if collecting:
            gc.enable()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code of ``--help``, ``--version`` or a bad flag (already reported)."""
    try:
        return _parser().parse_args(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 2


def _run(args) -> int:
    return _guarded(args.command, lambda: _command(args.command).run(args))


def _command(name: str):
    """The module of command ``name`` in :mod:`layout_prop.commands`."""
    import importlib

    return importlib.import_module(f"layout_prop.commands.{COMMANDS[name]}")


def _guarded(what: str, work):
    """``work()``, with every exception it may raise turned into an exit code and at most one
    stderr line: whatever an op's rule, kernel or plugin raises (any BaseException, even
    one that is neither an Exception nor SystemExit), never a traceback.  Only a failed
    write of the output itself goes on, to :func:`main`."""
    try:
        return work()
    except _OutputFailed:
        raise
    except LayoutPropError as err:
        print(_error_text(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("layout-prop: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # raised by an op's code (a plugin, a --module file): keep the contract
        _error_line("unexpected-exit", f"op code called exit({cut(exc.code)})",
                    "an op's rule or kernel must raise an error, not exit; fix the op module")
        return 2
    except MemoryError:
        _error_line("out-of-memory", f"{what} ran out of memory",
                    "use smaller shapes or fewer ranks (a run estimates its memory first: see --max-memory)")
        return 2
    except RecursionError:
        _error_line("too-deep", f"{what} recursed too deeply",
                    "the graph or a value nests too deeply; please report the spec")
        return 2
    except Exception as exc:  # a bug: one line that says so (LAYOUT_PROP_DEBUG=1 shows the traceback)
        if os.environ.get("LAYOUT_PROP_DEBUG"):
            raise
        _error_line("internal-error", describe(exc),
                    "this is a bug in layout-prop; please report it with the spec "
                    "(LAYOUT_PROP_DEBUG=1 shows the traceback)")
        return 2
    except BaseException as exc:  # noqa: B036 (GeneratorExit, or a class of an op's own derived from BaseException)
        if os.environ.get("LAYOUT_PROP_DEBUG"):
            raise
        _error_line("unexpected-exception", f"{what} was stopped by {describe(exc)}, which is not an Exception "
                    "(raised by an op's rule or kernel, or a plugin)",
                    "an op's code must raise an Exception (an OpError for a use it refuses), not a BaseException; "
                    "LAYOUT_PROP_DEBUG=1 shows the traceback")
        return 2


def _silence(stream) -> None:
    """Point a failed stream's file at /dev/null, so that the interpreter's last flush of
    what is still buffered cannot fail again (with a message) at exit."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file behind it (a test's capture): nothing to do
        pass


#: commands whose process may end with :func:`os._exit` once their output is flushed (see
#: :func:`entry`): they analyse one graph with numpy and Python only, and write their files
#: (``-o``) whole and closed before they return
HARD_EXIT_COMMANDS = frozenset({"check", "explain", "lower", "gen", "ops"})
#: set by :func:`entry`: None while :func:`main` may run in a process that goes on; then
#: whether the command run may end the process with :func:`os._exit`
_HARD_EXIT: bool | None = None


def entry() -> None:
    """The ``layout-prop`` console script: :func:`main`, then the process ends.

    After a command of :data:`HARD_EXIT_COMMANDS` that loaded no user module (``--module``)
    and left no exit handler (:mod:`atexit`), the process ends with :func:`os._exit` once stdout and
    stderr are flushed, as mypy does: the interpreter's teardown (every module freed, a last
    collection) costs about 55 million instructions (20 ms here) of a 0.17 s one-node
    check, and has nothing left to do.  Any other command exits the usual way.
    """
    global _HARD_EXIT
    import atexit

    _HARD_EXIT = False
    code = main()
    # (atexit._ncallbacks is CPython's; elsewhere the handlers are taken to be there)
    if _HARD_EXIT and getattr(atexit, "_ncallbacks", lambda: 1)() == 0 and _flushed():
        os._exit(code)
    sys.exit(code)


def _flushed() -> bool:
    """Flush stdout and stderr; whether both took everything (else the usual exit reports it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            return False
    return True


if __name__ == "__main__":
    entry()
