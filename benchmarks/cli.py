"""End-to-end benchmark of the command line: what a user waits for, start-up included.

Runs the real ``layout-prop`` CLI (``python -m layout_prop.cli``) as a subprocess on
chains of RotaryPositionEmbedding blocks (an RPE, a scale and a residual add per block,
on a dp x tp x sp mesh of 8 ranks) written as JSON and as YAML, with text and ``--json``
output, and prints for each: the net time of a size, the median over ``--repeat`` rounds of
its wall time minus that of the start-up (``check`` of a one-node spec of the same format)
run just before it in the same round (sizes interleaved; a paired difference cancels the
machine's slow drift, and a median is not biased by the number of runs as a best-of
difference is), microseconds per node, the ratio time(10N) / time(N) measured in the same
run, and the cost of one more node between the smallest and the largest size (start-up and
fixed costs cancel there).  The runs may cache compiled modules (``PYTHONDONTWRITEBYTECODE``
is dropped from their environment), as an installed tool does, and one untimed run comes
first.  Then the start-up itself (``--help``; ``check`` of a one-node spec) and, with
``--large``, a generated Llama model of about 100,000 nodes (``gen llama --layers 3125``: 23
nodes and 9 weights a layer; 320 layers make about 10,000) checked with ``--reshard
--json``: wall time and the peak memory of the process.

Run: ``python benchmarks/cli.py [--sizes 1000 10000] [--repeat 11] [--large]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

CLI = [sys.executable, "-m", "layout_prop.cli"]
#: the environment of every run: Python may cache compiled modules, as an installed tool does
#: (a session with PYTHONDONTWRITEBYTECODE set would otherwise compile every module on each run)
ENV = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def rpe_chain(nodes: int) -> dict:
    """The spec of a chain of RPE blocks with about ``nodes`` nodes."""
    spec = {"mesh": {"shape": [2, 2, 2], "names": ["dp", "tp", "sp"]},
            "inputs": {"x": {"shape": [8, 16, 128, 64], "placements": ["S(0)", "S(1)", "S(2)"]},
                       "cos": {"shape": [1, 1, 128, 64], "placements": ["R", "R", "S(2)"], "requires_grad": False},
                       "sin": {"shape": [1, 1, 128, 64], "placements": ["R", "R", "R"], "requires_grad": False},
                       "w": {"shape": [64], "placements": ["R", "R", "R"]}},
            "nodes": [], "outputs": []}
    x = "x"
    for i in range(max(1, nodes // 3)):
        spec["nodes"] += [
            {"name": f"rope{i}", "op": "rotary_position_embedding", "inputs": [x, "cos", "sin"],
             "attrs": {"mode": i % 4}},
            {"name": f"scale{i}", "op": "mul", "inputs": [f"rope{i}", "w"]},
            {"name": f"res{i}", "op": "add", "inputs": [f"scale{i}", x]},
        ]
        x = f"res{i}"
    spec["outputs"] = [x]
    return spec


def write(spec: dict, path: Path) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(spec))
    else:
        path.write_text(yaml.safe_dump(spec, default_flow_style=None, sort_keys=False))
    return path


def timed(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak resident memory (bytes) of one CLI run; its output is discarded."""
    start = time.perf_counter()
    process = subprocess.Popen(CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(args)} exited {process.returncode}: {process.stderr.read().decode()}")
    process.stderr.close()
    return elapsed, usage.ru_maxrss * 1024


def best(args: list[str], repeat: int) -> float:
    return min(timed(args)[0] for _ in range(repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000], help="nodes (default 1000 10000)")
    parser.add_argument("--repeat", type=int, default=11, help="rounds; the median of each size's net times "
                        "counts (default 11)")
    parser.add_argument("--large", action="store_true", help="also check a generated Llama of about 100,000 nodes")
    parser.add_argument("--large-layers", type=int, default=3125, help="its layers (default 3125)")
    args = parser.parse_args()
    if args.repeat < 1 or min(args.sizes) < 2:
        parser.error("--repeat must be at least 1 and every size at least 2 nodes")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = {(n, fmt): write(rpe_chain(n), folder / f"rpe{n}.{fmt}") for n in [1, *args.sizes]
                 for fmt in ("json", "yaml")}
        cases = [(fmt, out) for fmt in ("json", "yaml") for out in ("text", "json")]
        times: dict[tuple, list[float]] = {}
        for fmt in ("json", "yaml"):  # once untimed: the compiled modules cached, the files in the page cache
            timed(["check", str(files[1, fmt])])
        for _ in range(args.repeat):
            for fmt, out in cases:  # interleaved: every case and size once per round
                for n in [1, *args.sizes]:
                    flags = ["--json"] if out == "json" else []
                    times.setdefault((n, fmt, out), []).append(timed(["check", str(files[n, fmt]), *flags])[0])
        help_time = best(["--help"], args.repeat)

        print(f"start-up: --help {help_time:.3f} s; check of a one-node spec "
              f"{min(times[1, 'json', 'text']):.3f} s (JSON), {min(times[1, 'yaml', 'text']):.3f} s (YAML)")
        print()
        header = ["input", "output", *[f"{n:,} nodes (s)" for n in args.sizes],
                  *[f"us/node at {n:,}" for n in args.sizes]]
        if len(args.sizes) > 1:
            header.append(f"time({args.sizes[-1]:,}) / time({args.sizes[0]:,})")
            header.append(f"us/node from {args.sizes[0]:,} to {args.sizes[-1]:,}")
        rows = [header]
        for fmt, out in cases:
            # each round's time minus the start-up's of the same round; a net time at or below 0 is
            # lost in the start-up's noise: "n/a", never a made-up ratio
            net = [statistics.median(t - t1 for t, t1 in zip(times[n, fmt, out], times[1, fmt, out]))
                   for n in args.sizes]
            row = [fmt, out, *[f"{t:.3f}" for t in net],
                   *[f"{1e6 * t / n:.1f}" if t > 0 else "n/a" for t, n in zip(net, args.sizes)]]
            if len(args.sizes) > 1:
                row.append(f"{net[-1] / net[0]:.3g}" if net[0] > 0 and net[-1] > 0 else "n/a")
                # the cost of one more node, start-up and fixed costs cancelled
                row.append(f"{1e6 * (net[-1] - net[0]) / (args.sizes[-1] - args.sizes[0]):.1f}")
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for i, row in enumerate(rows):
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
            if i == 0:
                print("  ".join("-" * w for w in widths))
        print(f"(net times: the median over {args.repeat} rounds of a run's time minus the start-up's, a one-node "
              "check of the same format and output, in the same round)")

        if args.large:
            big = folder / "llama.json"
            subprocess.run(CLI + ["gen", "llama", "--layers", str(args.large_layers), "-o", str(big)], check=True,
                           stderr=subprocess.DEVNULL)
            spec = json.loads(big.read_text())
            nodes = len(spec["nodes"]) + len(spec["inputs"])
            elapsed, peak = timed(["check", str(big), "--reshard", "--json"])
            print()
            print(f"gen llama --layers {args.large_layers} ({nodes:,} nodes, inputs included): check --reshard "
                  f"--json {elapsed:.2f} s, peak memory {peak / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
