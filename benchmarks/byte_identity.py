"""Every command's output, recorded to compare two copies of the code byte for byte (a restructuring
that should change no behaviour: issue 37's thin commands, the pass pipeline before it).

``record`` runs a fixed list of command lines through one copy's ``layout-prop`` and stores, for each,
its stdout, stderr, exit code and the files it wrote; ``compare`` diffs two records and lists every case
whose stdout, stderr, exit code or files differ.  The list: ``--version``, ``--help`` of the program and of
every command, bad flags, bad and missing files; on examples/ (the Llama block, the RPE specs) check (with
--reshard, --backward, --json), run, lower, explain, viz (.dot), estimate, export to each target, import of
the ONNX example with its plan; ops (all, one, --json, --markdown); verify of one op; and ``gen`` of 30
models (llama, gpt, moe over several meshes, context parallelism, ZeRO, recompute, pipelines, dtypes), each
then checked, estimated, lowered, planned (a copy with every weight ``auto``) and, with a pipeline,
summarised.  ``plan --search`` runs on two of them.

Each copy runs in its own scratch folder holding a link ``examples`` to its checkout's examples, so that
the paths a command prints are the same in both; ``gen`` writes its specs there, and the later cases read
them.  Cases run one at a time (the solver's wall-clock limit makes a loaded machine's answers differ:
re-run a differing case alone in both copies before believing it).

Run::

    python benchmarks/byte_identity.py record --cli /tmp/before/.venv/bin/layout-prop --examples \\
        /tmp/before/examples --out /tmp/bi/before
    python benchmarks/byte_identity.py record --cli .venv/bin/layout-prop --examples examples --out /tmp/bi/after
    python benchmarks/byte_identity.py compare /tmp/bi/before /tmp/bi/after

``--only TEXT[,TEXT...]`` records the cases whose name holds one of the TEXTs (the ``gen`` cases they read are run
too), into the same record (a case re-run alone replaces its file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

#: the environment of every run: the terminal width fixed (argparse wraps --help to it), no colour
ENV_FIXED = {"COLUMNS": "100", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "NO_COLOR": "1", "PYTHONHASHSEED": "0"}
#: seconds one command may take before it is recorded as timed out
TIMEOUT = 600

EXAMPLES = ["examples/llama_block.yaml", "examples/rpe/dp_b.yaml", "examples/rpe/dp_sp.yaml",
            "examples/rpe/dp_tp.yaml"]
COMMANDS = ["check", "run", "demo", "explain", "verify", "audit", "viz", "import", "plan", "gen", "estimate",
            "pipeline", "export", "ops", "lower"]

#: (name, gen's arguments): 30 generated models
GEN = [
    ("llama1", ["llama"]),
    ("llama2", ["llama", "--layers", "2"]),
    ("llama_full", ["llama", "--full"]),
    ("llama_full_tied", ["llama", "--full", "--tie-embeddings", "--layers", "2"]),
    ("llama_tp4", ["llama", "--mesh", "dp=2,tp=4"]),
    ("llama_dp8", ["llama", "--mesh", "dp=8", "--batch", "8"]),
    ("llama_gqa", ["llama", "--kv-heads", "2", "--heads", "4"]),
    ("llama_ring", ["llama", "--context-parallel", "ring"]),
    ("llama_ulysses", ["llama", "--context-parallel", "ulysses"]),
    ("llama_cp_auto", ["llama", "--context-parallel", "auto"]),
    ("llama_bf16", ["llama", "--dtype", "bfloat16"]),
    ("llama_f16_full", ["llama", "--dtype", "float16", "--full"]),
    ("llama_zero1", ["llama", "--zero", "1", "--layers", "2"]),
    ("llama_zero3_full", ["llama", "--zero", "3", "--full"]),
    ("llama_recompute", ["llama", "--recompute", "full", "--layers", "2"]),
    ("llama_selective", ["llama", "--recompute", "selective"]),
    ("llama_accum", ["llama", "--micro-batches", "2", "--micro-batch", "1", "--full"]),
    ("llama_pp", ["llama", "--full", "--mesh", "pp=2,dp=2,tp=2", "--layers", "2", "--micro-batches", "2"]),
    ("llama_pp_gpipe", ["llama", "--full", "--mesh", "pp=2,dp=2,tp=2", "--layers", "2", "--micro-batches", "4",
                        "--schedule", "gpipe"]),
    ("llama_pp_inter", ["llama", "--full", "--mesh", "pp=2,dp=1,tp=2", "--layers", "4", "--micro-batches", "4",
                        "--schedule", "interleaved", "--virtual-stages", "2"]),
    ("llama_pp_zero", ["llama", "--full", "--mesh", "pp=2,dp=2,tp=2", "--layers", "2", "--micro-batches", "2",
                       "--zero", "1", "--recompute", "full"]),
    ("gpt1", ["gpt"]),
    ("gpt2", ["gpt", "--layers", "2", "--dropout", "0"]),
    ("gpt_tp4", ["gpt", "--mesh", "dp=2,tp=4"]),
    ("gpt_pp", ["gpt", "--mesh", "pp=2,dp=2,tp=2", "--layers", "2", "--micro-batches", "2"]),
    ("moe1", ["moe"]),
    ("moe_capacity", ["moe", "--capacity-factor", "1.25", "--capacity-scope", "group"]),
    ("moe_shared", ["moe", "--shared-experts", "1", "--router", "sigmoid", "--dense-layers", "1", "--layers", "2"]),
    ("moe_full", ["moe", "--full", "--top-k", "1", "--experts", "2"]),
    ("moe_zero2", ["moe", "--zero", "2"]),
]
#: the gen specs planned with every weight auto, and the one searched
PLANNED = ["llama1", "llama2", "llama_full", "gpt1", "moe1", "llama_ring"]
SEARCHED = ["llama_full", "gpt1"]


def cases() -> list[tuple[str, list[str]]]:
    """Every case: (name, the arguments after ``layout-prop``), in the order they run."""
    out: list[tuple[str, list[str]]] = [("version", ["--version"]), ("help", ["--help"]), ("no-command", [])]
    out += [(f"help-{c}", [c, "--help"]) for c in COMMANDS]
    out += [
        ("bad-command", ["chek", "x.yaml"]),
        ("bad-flag", ["check", EXAMPLES[0], "--reshrad"]),
        ("bad-choice", ["check", EXAMPLES[0], "--backend", "nump"]),
        ("bad-int", ["lower", EXAMPLES[0], "--rank", "x1"]),
        ("bad-rank", ["lower", EXAMPLES[0], "--rank", "99"]),
        ("bad-seconds", ["run", EXAMPLES[0], "--max-time", "0"]),
        ("bad-size", ["run", EXAMPLES[0], "--max-memory", "12Q"]),
        ("bad-batch", ["estimate", EXAMPLES[0], "--cluster", "a100-80g", "--global-batch", "0"]),
        ("bad-cluster", ["estimate", EXAMPLES[0], "--cluster", "z100"]),
        ("missing-file", ["check", "missing.yaml"]),
        ("bad-yaml", ["check", "bad.yaml"]),
        ("bad-spec", ["check", "badspec.yaml"]),
        ("missing-required", ["estimate", EXAMPLES[0]]),
        ("bad-zero-layers", ["estimate", EXAMPLES[0], "--cluster", "a100-80g", "--recompute", "none",
                             "--recompute-layers", "l0"]),
        ("search-missing", ["plan", EXAMPLES[0], "--search"]),
        ("pipeline-none", ["pipeline", EXAMPLES[0]]),
        ("explain-unknown", ["explain", EXAMPLES[0], "nosuch"]),
        ("verify-unknown", ["verify", "unbind9"]),
        ("ops-unknown", ["ops", "matmull"]),
    ]
    for i, spec in enumerate(EXAMPLES):
        e = f"ex{i}"
        out += [(f"{e}-check", ["check", spec]), (f"{e}-check-json", ["check", spec, "--json"]),
                (f"{e}-check-reshard", ["check", spec, "--reshard"]),
                (f"{e}-check-rb-json", ["check", spec, "--reshard", "--backward", "--json", "--optimizer", "adam"]),
                (f"{e}-run", ["run", spec, "--backward"]), (f"{e}-run-json", ["run", spec, "--json"]),
                (f"{e}-lower", ["lower", spec, "--rank", "0"]),
                (f"{e}-lower-bj", ["lower", spec, "--rank", "1", "--backward", "--json"]),
                (f"{e}-viz-dot", ["viz", spec, "--reshard", "-o", f"out/{e}.dot"]),
                (f"{e}-estimate", ["estimate", spec, "--cluster", "a100-80g"]),
                (f"{e}-estimate-json", ["estimate", spec, "--cluster", "h100-80g", "--json", "--zero", "1"])]
        out += [(f"{e}-export-{t}", ["export", spec, "--to", t]) for t in ("hyper-parallel", "mindspore", "torch")]
    out += [
        ("ex0-explain", ["explain", EXAMPLES[0], "l0_out"]),
        ("ex0-explain-rb", ["explain", EXAMPLES[0], "grad:model.layers.0.self_attn.q_proj.weight", "--reshard",
                            "--backward", "--json"]),
        ("ex1-explain", ["explain", EXAMPLES[1], "grad:x", "--backward"]),
        ("ex0-viz-grid", ["viz", EXAMPLES[0], "--tensor", "model.layers.0.self_attn.q_proj.weight", "-o",
                          "out/grid.dot"]),
        ("ex0-export-data", ["export", EXAMPLES[0], "--to", "torch", "-o", "out/plan.py", "--data", "out/plan.yaml",
                             "--input", "x"]),
        ("import-onnx", ["import", "examples/llama_block.onnx", "--plan", "examples/llama_plan.yaml"]),
        ("import-params", ["import", "examples/llama_block.onnx"]),
        ("check-onnx", ["check", "examples/llama_block.onnx", "--plan", "examples/llama_plan.yaml", "--reshard"]),
        ("ops", ["ops"]), ("ops-one", ["ops", "matmul"]), ("ops-json", ["ops", "--json"]),
        ("ops-markdown", ["ops", "--markdown"]), ("ops-alias", ["ops", "unbind"]),
        ("verify-add", ["verify", "add", "--mesh", "2", "--samples", "4"]),
        ("verify-matmul-json", ["verify", "matmul", "--mesh", "2x2", "--samples", "3", "--backward", "--json"]),
    ]
    for name, args in GEN:
        spec = f"gen/{name}.yaml"
        out += [(f"gen-{name}", ["gen", *args, "-o", spec]),
                (f"{name}-check-reshard", ["check", spec, "--reshard"]),
                (f"{name}-check-rb-json", ["check", spec, "--reshard", "--backward", "--json"]),
                (f"{name}-estimate", ["estimate", spec, "--cluster", "a100-80g"]),
                (f"{name}-lower", ["lower", spec, "--rank", "0"])]
        if "--mesh" in args and args[args.index("--mesh") + 1].startswith("pp="):
            out += [(f"{name}-pipeline", ["pipeline", spec]), (f"{name}-pipeline-json", ["pipeline", spec, "--json"]),
                    (f"{name}-pipeline-rank", ["pipeline", spec, "--rank", "1"]),
                    (f"{name}-estimate-json", ["estimate", spec, "--cluster", "a100-80g", "--json"])]
        if name in ("llama1", "gpt1"):
            out += [(f"{name}-stdout", ["gen", *args])]
        if name in PLANNED:
            out += [(f"{name}-plan", ["plan", f"gen/{name}_auto.yaml", "--baseline", spec]),
                    (f"{name}-plan-json", ["plan", f"gen/{name}_auto.yaml", "--json", "--cluster", "a100-80g",
                                           "-o", f"out/{name}_planned.yaml"])]
        if name in SEARCHED:
            out += [(f"{name}-search", ["plan", spec, "--search", "--cluster", "a100-80g", "--devices", "8",
                                        "--global-batch", "16", "--top", "3"]),
                    (f"{name}-search-json", ["plan", spec, "--search", "--cluster", "a100-80g", "--devices", "8",
                                             "--global-batch", "16", "--json", "--plan-out", f"out/{name}_plan.yaml"])]
    out += [("llama_pp-run", ["pipeline", "gen/llama_pp.yaml", "--run"]),
            ("llama_pp-run-cmd", ["run", "gen/llama_pp.yaml"]),
            ("llama_zero1-run", ["run", "gen/llama_zero1.yaml", "--backward"])]
    return out


def _auto_copy(spec: Path, target: Path) -> None:
    """``spec`` with every input that has a gradient written ``placements: auto`` (plan's input)."""
    import yaml

    data = yaml.safe_load(spec.read_text())
    for name, value in data["inputs"].items():
        if value.get("requires_grad", True) and name not in ("x", "tokens", "labels"):
            value["placements"] = "auto"
    data.pop("pipeline", None)
    target.write_text(yaml.safe_dump(data, sort_keys=False))


def _prepare(work: Path, examples: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("gen", "out"):
        (work / sub).mkdir(exist_ok=True)
    link = work / "examples"
    if not link.exists():
        link.symlink_to(examples.resolve())
    (work / "bad.yaml").write_text("mesh: [2\ninputs: {\n")
    (work / "badspec.yaml").write_text("mesh: {shape: [2], names: [dp]}\ninputs:\n  x: {shape: [4, 3], placements: "
                                       "[S(2)]}\nnodes:\n  - {name: y, op: relu, inputs: [x]}\noutputs: [y]\n")


def _files(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            out[path.relative_to(folder).as_posix()] = path.read_bytes().decode("utf-8", "replace")
    return out


def record(cli: list[str], examples: Path, out: Path, only: str | None) -> int:
    """Run every case with ``cli`` in ``out/work``; one JSON file a case in ``out/cases``."""
    work, store = out / "work", out / "cases"
    _prepare(work, examples)
    store.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV_FIXED}
    env.pop("LAYOUT_PROP_DEBUG", None)
    chosen = cases()
    if only:
        wanted = [c for c in chosen if any(part in c[0] for part in only.split(","))]
        needed = {a for _, args in wanted for a in args if a.startswith("gen/")}
        chosen = [c for c in chosen if c in wanted or (c[0].startswith("gen-") and f"gen/{c[0][4:]}.yaml" in needed)]
    start = time.perf_counter()
    for n, (name, args) in enumerate(chosen, 1):
        for stale in (work / "out").iterdir():
            stale.unlink()
        began = time.perf_counter()
        try:
            proc = subprocess.run([*cli, *args], cwd=work, env=env, capture_output=True, timeout=TIMEOUT,
                                  stdin=subprocess.DEVNULL)
            result = {"rc": proc.returncode, "stdout": proc.stdout.decode("utf-8", "replace"),
                      "stderr": proc.stderr.decode("utf-8", "replace")}
        except subprocess.TimeoutExpired:
            result = {"rc": "timeout", "stdout": "", "stderr": ""}
        result.update({"args": args, "files": _files(work / "out"), "seconds": round(time.perf_counter() - began, 2)})
        if (work / "layout-prop-demo.html").exists():
            result["files"]["layout-prop-demo.html"] = (work / "layout-prop-demo.html").read_text()
            (work / "layout-prop-demo.html").unlink()
        if name.startswith("gen-") and result["rc"] == 0:
            spec = work / "gen" / f"{name[4:]}.yaml"
            result["files"]["spec"] = spec.read_text()
            if name[4:] in PLANNED:
                _auto_copy(spec, work / "gen" / f"{name[4:]}_auto.yaml")
        (store / f"{name}.json").write_text(json.dumps(result, indent=1))
        print(f"[{n}/{len(chosen)}] {name}: exit {result['rc']} ({result['seconds']} s)", flush=True)
    print(f"{len(chosen)} cases in {time.perf_counter() - start:.0f} s")
    return 0


#: what a command prints of its own wall-clock time (plan's "in 59.51 s of a 60 s limit", --search's "11.0 s",
#: --json's "seconds": 7.806): masked when telling a difference of timing from one of output
TIMES = re.compile(r'\d+\.\d+ s\b|"seconds": ?[0-9.]+')


def _timed_only(x: dict, y: dict) -> bool:
    """Whether ``x`` and ``y`` differ only in the wall-clock seconds a command prints (:data:`TIMES`)."""
    return (x["rc"] == y["rc"] and x["files"] == y["files"]
            and all(TIMES.sub("<T>", x[k]) == TIMES.sub("<T>", y[k]) for k in ("stdout", "stderr")))


def compare(a: Path, b: Path) -> int:
    """Every case recorded in both ``a`` and ``b`` whose output differs, and whether only in the seconds a command
    prints of its own run; exit 1 if any differs otherwise."""
    names_a = {p.stem for p in (a / "cases").glob("*.json")}
    names_b = {p.stem for p in (b / "cases").glob("*.json")}
    both = sorted(names_a & names_b)
    differ = []
    for name in both:
        x, y = (json.loads((d / "cases" / f"{name}.json").read_text()) for d in (a, b))
        parts = [k for k in ("rc", "stdout", "stderr", "files") if x[k] != y[k]]
        if parts:
            differ.append((name, parts, _timed_only(x, y)))
            print(f"DIFFERS {name}: {', '.join(parts)}" + (" (only the seconds it printed)" if differ[-1][2] else ""))
            for k in parts:
                if k in ("stdout", "stderr"):
                    import difflib

                    for line in list(difflib.unified_diff(x[k].splitlines(), y[k].splitlines(), lineterm="", n=1))[:12]:
                        print(f"    {line[:200]}")
                elif k == "rc":
                    print(f"    exit {x['rc']} -> {y['rc']}")
    only = sorted(names_a ^ names_b)
    timed = sum(1 for d in differ if d[2])
    print(f"{len(both)} cases compared (stdout, stderr, exit code, files written): {len(both) - len(differ)} "
          f"identical, {len(differ)} different ({timed} only in the wall-clock seconds they print); {len(only)} "
          "recorded on one side only" + (f": {', '.join(only[:10])}" if only else ""))
    return 1 if len(differ) > timed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record", help="run every case with one copy's layout-prop")
    r.add_argument("--cli", required=True, help="the layout-prop executable (or 'PYTHON -m layout_prop.cli')")
    r.add_argument("--examples", type=Path, required=True, help="that copy's examples folder")
    r.add_argument("--out", type=Path, required=True, help="a folder for the record")
    r.add_argument("--only", help="only the cases whose name holds one of these texts (comma-separated)")
    c = sub.add_parser("compare", help="diff two records")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args(argv)
    if args.what == "record":
        return record(args.cli.split(), args.examples, args.out, args.only)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
