"""``layout-prop run``: lower, execute every rank, assemble, and compare with one device.

The graph inputs are drawn at random (``--seed``) unless given: ``--inputs FILE.npz`` holds
arrays by input name (:func:`read_inputs`), and a model run with ``--plan`` feeds the model's
own initialisers (:func:`load_with_weights`); the file wins over the model's weights.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np

from layout_prop.core.errors import ExecutionError, SpecError, cut

from layout_prop.workflows.model_input import load_graph
from .printing import print_json
from .flags import (
    add_model_args, count_arg, memory_size_arg, node_rank_arg, non_negative_int, positive_int, seconds_arg,
    tolerance_arg,
)

__all__ = ["add_parser", "run", "read_inputs", "load_with_weights", "MAX_INPUTS_BYTES"]

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


def load_with_weights(args) -> tuple:
    """``(graph, weights, unread)``: the graph :func:`load_graph` gives, and for ``MODEL --plan
    PLAN`` the model's own value of each weight and constant input (by input name, from
    ``graph.meta["import_sources"]``), with the names of those whose data was not read (kept
    in external data files: they are drawn at random)."""
    from layout_prop.frontends import is_model_path

    if not is_model_path(str(args.spec)) or args.plan is None:
        return load_graph(args.spec, args.plan, args.opaque), {}, []  # (load_graph refuses a model without a plan)
    from layout_prop.core.dependencies import require_model_reader
    from layout_prop.core.graph import paused_gc
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    require_model_reader(str(args.spec))
    plan = load_plan(Path(args.plan))
    with paused_gc():
        model = read_model(args.spec, plan)
        graph = build_graph(model, plan, opaque=args.opaque)
    weights, unread = {}, []
    for name, value in graph.meta["import_sources"].items():
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


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop run``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("run", help="lower, execute every rank, and compare with one device")
    parser.add_argument("spec", metavar="SPEC", help="a YAML or JSON spec file (- reads standard input)")
    parser.add_argument("--engine", choices=["sim", "mindspore"], default="sim", help="execution engine (default sim)")
    parser.add_argument("--backend", choices=["numpy", "mindspore", "cann"], default=None,
                        help="kernel backend (default: numpy on sim, mindspore on the mindspore engine)")
    parser.add_argument("--backward", action="store_true", help="also run the backward and compare gradients")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--no-reshard", action="store_true", help="refuse (exit 1) instead of inserting redistributions")
    parser.add_argument("--timeout", type=seconds_arg, default=None,
                        help="mindspore engine: seconds before giving up (default 300, at most a week)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="mindspore engine: keep the run folder (worker logs) after a successful run too")
    parser.add_argument("--nodes", type=count_arg, default=1,
                        help="mindspore engine: machines the run spans (default 1)")
    parser.add_argument("--node-rank", type=node_rank_arg, default=0,
                        help="mindspore engine: this machine's node (default 0)")
    parser.add_argument("--master-addr", metavar="HOST", help="mindspore engine: host of msrun's scheduler (--nodes)")
    parser.add_argument("--master-port", type=positive_int, metavar="P",
                        help="mindspore engine: its port (1024-65535; default a free one on one machine, msrun's 8118 "
                             "across machines)")
    parser.add_argument("--local-workers", type=count_arg, metavar="W",
                        help="mindspore engine: workers a node (default the mesh's ranks over --nodes)")
    parser.add_argument("--emulate-nodes", type=count_arg, metavar="N",
                        help="mindspore engine: run N nodes on this machine, each through its own msrun (for tests)")
    parser.add_argument("--rtol", type=tolerance_arg, default=None,
                        help="relative tolerance (default by dtype: float64 1e-12, float32 1e-5, float16 1e-2, bfloat16 "
                             "8e-2)")
    parser.add_argument("--inputs", type=Path, default=None, metavar="FILE.npz",
                        help="global arrays of some or all graph inputs, keyed by input name (numpy.savez; no pickles); "
                             "the others are drawn at random, or with MODEL --plan PLAN are the model's own weights")
    from layout_prop.io.sizes import GRAMMAR as SIZE_GRAMMAR  # --max-memory's grammar, the same as plan --memory-per-rank's
    parser.add_argument("--max-memory", type=memory_size_arg, default=None, metavar="SIZE",
                        help="refuse a run whose estimated memory exceeds SIZE (like 4096, 512M, 8GB, 1.5TiB; default: "
                             f"the memory available now); {SIZE_GRAMMAR}")
    parser.add_argument("--max-time", type=seconds_arg, default=None, metavar="SECONDS",
                        help="refuse a run on the simulator estimated to take longer than SECONDS (default 300, at most "
                             "a week); the estimate counts elements, bytes and ranks")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(parser)
    return parser


def run(args) -> int:
    from layout_prop.runner import format_nonfinite, run_graph

    backend = args.backend or ("numpy" if args.engine == "sim" else "mindspore")
    nodes = {"nodes": args.nodes, "node_rank": args.node_rank, "master_addr": args.master_addr,
             "master_port": args.master_port, "local_workers": args.local_workers, "emulate_nodes": args.emulate_nodes}
    if args.engine != "mindspore" and (args.nodes != 1 or args.emulate_nodes or args.master_addr or args.node_rank
                                       or args.master_port is not None or args.local_workers is not None
                                       or args.timeout is not None or args.keep_logs):
        raise SpecError("bad-usage", "--timeout, --keep-logs, --nodes, --emulate-nodes, --master-addr, --master-port, "
                        "--node-rank and --local-workers need --engine mindspore (the simulator runs in this "
                        "process)", hint="add --engine mindspore, or drop them")
    if args.engine == "mindspore" and args.max_time is not None:
        raise SpecError("bad-usage", "--max-time limits the simulator's estimated time; the mindspore engine runs "
                        "every rank in its own process and gives up after --timeout instead",
                        hint="drop --max-time, or use --timeout SECONDS with --engine mindspore")
    if args.engine == "mindspore":
        from layout_prop.core.dependencies import require

        require("mindspore", "run --engine mindspore")  # before the spec is read and analysed
    elif backend != "numpy":  # (run_graph says so too, but after the analysis and the one-device run)
        raise ExecutionError("backend-unavailable", f"the simulator runs the numpy kernels, not {backend!r}",
                             hint="use --engine mindspore for the mindspore and cann backends")
    timeout = 300.0 if args.timeout is None else args.timeout
    options = {"timeout": timeout, "keep": args.keep_logs, **nodes} if args.engine == "mindspore" else {}
    from layout_prop.io.progress import Ticker

    quiet = False if args.json else None  # the progress lines: on a terminal only, never with --json
    with Ticker("run", enabled=quiet) as ticker:
        ticker.say("reading the spec")
        graph, weights, unread = load_with_weights(args)
    from layout_prop.workflows.blocks import read_blocks

    blocks = read_blocks(graph)  # the spec's zero:, recompute:, pipeline: blocks (a bad one: exit 2)
    if blocks.pipeline is not None:
        return _run_pipelined(args, graph, blocks, weights, backend)
    configured, transformed = {}, {}
    if blocks.any:
        configured = _configured(args, graph, blocks, transformed)
        graph = configured.pop("graph")
    from_file = {}
    if args.inputs is not None:  # checked here, so that an error names the file
        from layout_prop.runner import check_given_inputs

        from_file = check_given_inputs(graph, read_inputs(args.inputs), str(args.inputs))
    given = {**weights, **from_file}
    with Ticker("run", enabled=quiet) as ticker:  # the simulator reports no steps: the phase and the time
        ticker.say(f"{graph.mesh.size:,} ranks on {'msrun' if args.engine == 'mindspore' else 'the simulator'}: "
                   "analysing, lowering, one device, every rank")
        if args.engine == "mindspore":
            options["progress"] = lambda text: ticker.say(f"msrun: {text}")  # ranks joined and finished
        rep = run_graph(graph, engine=args.engine, backend=backend, backward=args.backward, seed=args.seed,
                        reshard=not args.no_reshard, rtol=args.rtol, max_memory=args.max_memory,
                        max_time=args.max_time, inputs=given, **configured, **options)
    rep.extra["inputs"] = _input_sources(graph, weights, from_file, unread)
    if rep.ok and "graph" in transformed and blocks.zero_stage and args.engine == "sim":
        _optimizer_step(rep, transformed["graph"], blocks, args, given)
    if blocks.any:
        rep.extra["config"] = {**blocks.to_dict(), "note": _configured_note(blocks, args, rep)}
        rep.notes.append(f"config: {rep.extra['config']['note']}")
    if rep.extra.get("node_rank"):  # not node 0: node 0 prints the report; the status is the same everywhere
        summary = {"ok": rep.ok, "node_rank": rep.extra["node_rank"], "nodes": len(rep.extra["nodes"])}
        print(json.dumps(summary) if args.json else f"node {summary['node_rank']} of {summary['nodes']}: "
              f"{'matches' if rep.ok else 'does NOT match'} one device (the report is printed on node 0)")
        return 0 if rep.ok else 1
    if args.json:
        print_json(rep.to_dict())
    else:
        if not rep.executed:
            for v in rep.violations:
                print(f"violation [{v['code']}] {v['node']}.{v['operand']}: {v['message']} (fix: {v['hint']})")
            if args.no_reshard:
                why = "and --no-reshard (without it, run inserts the redistributions that fix what they can)"
            else:
                why = "that no redistribution fixes"
            print(f"nothing was executed: {len(rep.violations)} violation(s) {why}")
            return 1
        print(f"engine {rep.engine}, {rep.ranks} ranks")
        if given:
            print(f"  inputs: {_sources_line(rep.extra['inputs'], args.inputs)}")
        for line in rep.extra.get("node_map", []):
            print(f"  {line}")
        for line in rep.extra.get("compute_notes", []):  # how the engine computed (bfloat16 on mindspore)
            print(f"  note: {line}")
        for line in rep.notes:  # what was executed instead of a node as written (a ring, a vocabulary-parallel
            if line.startswith("expand:"):  # loss), or why a form asked for was not taken
                print(f"  note: {line}")
        if "config" in rep.extra:
            print(f"  note: config: {rep.extra['config']['note']}")
        step = rep.extra.get("optimizer_step")
        if step is not None:
            worst = max((e["max_rel_err"] for e in step["params"].values()), default=0.0)
            print(f"  optimizer step ({step['optimizer']} on the ZeRO-{step['stage']} shards, "
                  f"{len(step['update_collectives'])} collectives after the update): {len(step['params'])} parameters "
                  f"{'equal to' if step['ok'] else 'NOT equal to'} one device's update, max rel err {worst:.3g}")
        for title, table in (("output", rep.outputs), ("grad", rep.grads)):
            for name, err in table.items():
                print(f"  {title} {name}: max abs err {err['max_abs_err']:.3g}, max rel err {err['max_rel_err']:.3g}")
        for c in rep.collectives:
            print(f"  collective {c['kind']} on {c['mesh_axis']} for {c['node']}: {c['bytes_per_rank']} bytes/rank")
        for c in rep.extra.get("emulated_collectives", []):
            print(f"  emulated on this device: {c}")
        if rep.extra.get("run_dir"):
            print(f"  worker logs: {rep.extra['run_dir']}")
        for v in rep.violations:
            print(f"  violation [{v['code']}] {v['node']}.{v['operand']}: {v['message']} (fix: {v['hint']})")
        for m in rep.mismatches:
            print(f"  MISMATCH {m}")
        result = "matches one device" if rep.ok else "does NOT match one device"
        if rep.nonfinite:  # compare counts NaN == NaN and equal infinities as agreement: say where it did
            result += ", counting NaN and inf as equal where both have them:"
        print(result)
        for item in rep.nonfinite:
            print(f"  {format_nonfinite(item)}")
    return 0 if rep.ok else 1


def _configured(args, graph, blocks, transformed: dict) -> dict:
    """run_graph's arguments for a spec's zero:/recompute: blocks: the forward graph with ZeRO-3's gathers,
    the recomputation and ZeRO's finish applied to the analysed graph (with ``--backward``; the result is
    kept in ``transformed["graph"]``), and the reference: the spec's graph analysed without them (a copy,
    so that no node's metadata is shared)."""
    from layout_prop.api import analyze

    from layout_prop.workflows.blocks import forward, transform

    plain = analyze(graph.copy_structure(), reshard=not args.no_reshard, backward=args.backward)
    out = {"graph": forward(graph, blocks)}
    if plain.ok:
        out["reference_graph"] = plain.graph
        if plain.expanded:  # judge an expansion (a ring...) against the graph as written, as run_graph does
            out["reference_graph"] = analyze(graph.copy_structure(), reshard=False, backward=args.backward).graph
    if args.backward:
        def apply(analysed):
            transformed["graph"] = transform(analysed, blocks)
            return transformed["graph"]
        out["transform"] = apply
    return out


def _optimizer_step(rep, graph, blocks, args, given: dict) -> None:
    """ZeRO's update executed (engines/training.py ``training_step``): each rank updates its shard of every
    parameter from the gradients the run made (SGD with weight decay: its update is exact in every dtype,
    where AdamW's first step divides by a gradient's magnitude), the stage's all-gathers put the parameters
    back, and they are compared with one device's update.  A mismatch fails the run."""
    from layout_prop.engines.training import SGD, training_step
    from layout_prop.passes.lower import Lower
    from layout_prop.passes.zero import shard_layouts
    from layout_prop.runner import TOLERANCES, random_inputs

    dtypes = {s.dtype for n in graph.nodes for s in n.meta.get("specs", ()) if s is not None}
    rtol = args.rtol if args.rtol is not None else max((TOLERANCES.get(d, 0.0) for d in dtypes), default=1e-5)
    inputs = {**random_inputs(graph, args.seed, given=given), **given}  # the run's own draw
    step = training_step(graph, Lower().run(graph).program, inputs, shard_layouts(graph, blocks.zero),
                         blocks.zero.stage, SGD(lr=0.1, weight_decay=0.01), rtol=rtol)
    rep.extra["optimizer_step"] = step.to_dict()
    if not step.ok:
        rep.ok = False
        rep.mismatches.extend(f"optimizer step: {m}" for m in step.mismatches)


def _configured_note(blocks, args, rep) -> str:
    """What of the zero:/recompute: blocks the run executed, and what not."""
    from layout_prop.workflows.blocks import describe

    if not rep.executed:
        return f"{describe(blocks)}: nothing executed (violations)"
    ran, not_run = [], []
    if blocks.zero is not None and blocks.zero.stage == 3:
        ran.append("ZeRO-3's parameters stored sharded and gathered" + (", re-gathered for the backward, gradients "
                                                                       "reduce-scattered" if args.backward else ""))
    elif blocks.zero is not None and blocks.zero.stage:
        (ran if args.backward else not_run).append(f"ZeRO-{blocks.zero.stage}'s gradient reduce-scatters")
    if blocks.recompute != "none":
        (ran if args.backward else not_run).append("the recomputation copies")
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


#: the run options a pipelined run does not take (they are the single-program run's)
_NOT_PIPELINED = (("inputs", None, "--inputs"), ("no_reshard", False, "--no-reshard"), ("rtol", None, "--rtol"),
                  ("keep_logs", False, "--keep-logs"), ("nodes", 1, "--nodes"), ("node_rank", 0, "--node-rank"),
                  ("master_addr", None, "--master-addr"), ("master_port", None, "--master-port"),
                  ("local_workers", None, "--local-workers"), ("emulate_nodes", None, "--emulate-nodes"))


def _run_pipelined(args, graph, blocks, weights: dict, backend: str) -> int:
    """A spec with a ``pipeline:`` block: the pipelined program executed as ``layout-prop pipeline --run``
    executes it (commands/pipeline.py ``build`` and ``run_pipeline``, with the zero:/recompute: blocks), on
    every rank over the micro-batches, compared with one device on the whole batch."""
    from layout_prop.workflows.pipeline import build, run_pipeline

    for attr, default, flag in _NOT_PIPELINED:
        if vars(args)[attr] != default:
            raise SpecError("bad-usage", f"{flag} is not taken by a pipelined run (the spec has a pipeline: block)",
                            hint="drop it; layout-prop pipeline SPEC --run takes --engine, --seed and --timeout")
    if weights:
        raise SpecError("bad-usage", "a pipelined run draws its inputs at random; the model's own weights are not "
                        "fed to it", hint="write the model as a spec (layout-prop import) and run that")
    if backend != "numpy":
        raise SpecError("bad-usage", f"a pipelined run computes with the numpy kernels, not {backend!r}",
                        hint="drop --backend (msrun workers run numpy kernels with --engine mindspore)")
    from layout_prop.io.progress import Ticker

    options = {"backend": "numpy", "timeout": 300.0 if args.timeout is None else args.timeout} \
        if args.engine == "mindspore" else {}
    with Ticker("run", enabled=False if args.json else None) as ticker:  # on a terminal only
        ticker.say("analysing and lowering one micro-batch")
        built = build(graph, "a100-80g", blocks.zero, (blocks.recompute, blocks.layers))
        report = run_pipeline(built, args.seed, args.engine, progress=ticker.say, max_memory=args.max_memory,
                              max_time=args.max_time, **options)
    c = blocks.pipeline
    note = (f"{_describe(blocks)}: the pipelined program executed as layout-prop pipeline SPEC --run executes it "
            f"(one micro-batch's program on the stage mesh {built.program.program.mesh}, each stage's schedule, "
            f"the moves), forward and backward{'' if args.backward else ' (a schedule is of both: without --backward too)'}; "
            f"compared with one device on the whole batch"
            + ("; ZeRO's optimizer step is not run in a pipelined run" if blocks.zero_stage else ""))
    report["config"] = {**blocks.to_dict(), "note": note}
    if args.json:
        print_json(report)
    else:
        print(f"engine {report['engine']}, {report['ranks']} ranks: {c.stages} pipeline stages on {c.axis}, "
              f"{report['schedule']} over {report['micro_batches']} micro-batches")
        print(f"  note: config: {note}")
        for kind in ("outputs", "grads"):
            for name, err in report[kind].items():
                print(f"  {'output' if kind == 'outputs' else 'grad'} {name}: max abs err {err['max_abs_err']:.3g}, "
                      f"max rel err {err['max_rel_err']:.3g}")
        for problem in report["mismatches"]:
            print(f"  MISMATCH {problem}")
        print("matches one device" if report["ok"] else "does NOT match one device")
    return 0 if report["ok"] else 1


def _describe(blocks) -> str:
    from layout_prop.workflows.blocks import describe

    return describe(blocks)


def _input_sources(graph, weights: dict, from_file: dict, unread: list[str]) -> dict[str, list[str]]:
    """Where each graph input's value came from: ``{"file": [...], "model": [...], "random": [...]}``
    (``unread``: the model's weights not read from external data, drawn at random)."""
    names = [node.name for node in graph.inputs()]
    return {"file": [n for n in names if n in from_file],
            "model": [n for n in names if n in weights and n not in from_file],
            "random": [n for n in names if n not in from_file and n not in weights],
            "unread": [n for n in unread if n not in from_file]}


def _sources_line(sources: dict[str, list[str]], path) -> str:
    """``2 from in.npz, 9 the model's own, 1 drawn at random (x)``."""
    parts = []
    if sources["file"]:
        parts.append(f"{len(sources['file'])} from {cut(str(path))}")
    if sources["model"]:
        parts.append(f"{len(sources['model'])} the model's own")
    if sources["random"]:
        shown = ", ".join(sources["random"][:4]) + (", ..." if len(sources["random"]) > 4 else "")
        parts.append(f"{len(sources['random'])} drawn at random ({cut(shown)})")
    line = ", ".join(parts)
    if sources["unread"]:
        line += f"; {len(sources['unread'])} weights in external data files are not read (drawn at random)"
    return line
