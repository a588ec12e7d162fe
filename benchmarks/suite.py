"""The test suite's wall time and line coverage: the fast subset and the whole suite, in parallel and serially.

Every run is the README's test command (``python -m pytest``, with setup.cfg's options: pytest-xdist's
workers) from the repository root, in a fresh process, on this machine as it is: a loaded machine stretches
every time, so compare the rows of one run of this script (the ratios), and say the load (printed).

    python benchmarks/suite.py                  # the fast subset and the whole suite, in parallel
    python benchmarks/suite.py --serial         # and the whole suite in one process (-n 0)
    python benchmarks/suite.py --coverage       # every run under coverage.py: line coverage of layout_prop,
                                                # ops, passes and kernels (subprocesses included)
    python benchmarks/suite.py --only fast      # one row: fast, whole or serial
    python benchmarks/suite.py --record         # a whole-suite run that rewrites graph_tests/durations.json
    python benchmarks/suite.py --from-logs DIR  # durations.json from the per-test logs such a run wrote

The fast subset (``pytest -m fast``, graph_tests/conftest.py) is the tests that graph_tests/durations.json
records as cheap: ``--record`` times every test (CPU seconds of the test and the processes it waited for:
what a loaded machine does not stretch) and picks the largest threshold whose tests add up to at most
``--budget`` CPU seconds, plus each file's cheapest test (every package is exercised).  A test the record
does not name (new, or renamed) is not fast until the next recording; the table counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "graph_tests" / "durations.json"
PACKAGES = ("layout_prop", "ops", "passes", "kernels")
#: the environment variable naming the folder where benchmarks/suite_times.py logs each test
LOG_ENV = "LAYOUT_PROP_SUITE_TIMES"


# --------------------------------------------------------------------------- the runs
def read_logs(folder: Path) -> tuple[dict[str, float], dict[str, float]]:
    """``{node id: CPU seconds}`` and ``{node id: wall seconds}`` from the ``*.tsv`` logs of a run (lines of
    node id, wall, CPU; the last entry of a test wins)."""
    cpu: dict[str, float] = {}
    wall: dict[str, float] = {}
    for path in sorted(Path(folder).glob("*.tsv")):
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0].startswith("graph_tests/"):
                wall[parts[0]], cpu[parts[0]] = float(parts[1]), float(parts[2])
    return cpu, wall


def _fast_tests():
    sys.path.insert(0, str(ROOT / "graph_tests"))
    from conftest import fast_tests

    return fast_tests


def choose_threshold(cpu: dict[str, float], wall: dict[str, float], budget: float) -> float:
    """The largest per-test threshold whose fast subset (conftest ``fast_tests``) adds up to at most
    ``budget`` CPU seconds."""
    fast_tests = _fast_tests()
    best = 0.0
    for threshold in sorted(set(cpu.values())):
        if sum(cpu[name] for name in fast_tests(threshold, cpu, wall)) > budget:
            break
        best = threshold
    return best


def write_record(cpu: dict[str, float], wall: dict[str, float], budget: float, how: str) -> dict:
    threshold = choose_threshold(cpu, wall, budget)
    data = {"recorded": how, "budget_cpu_seconds": budget, "fast_seconds": threshold,
            "cpu_seconds": {name: round(cpu[name], 3) for name in sorted(cpu)},
            "wall_seconds": {name: round(wall[name], 2) for name in sorted(wall)}}
    DURATIONS.write_text(json.dumps(data, indent=0) + "\n")
    return data


def _coverage_rc(folder: Path) -> Path:
    rc = folder / "coveragerc"
    rc.write_text("[run]\nsource =\n" + "".join(f"    {ROOT / p}\n" for p in PACKAGES)
                  + f"parallel = True\ndata_file = {folder / '.coverage'}\n")
    return rc


def _coverage_figures(rc: Path, folder: Path) -> dict[str, float]:
    """Line coverage in percent, in total and by package, of the data the run left."""
    run = [sys.executable, "-m", "coverage"]
    subprocess.run(run + ["combine", f"--rcfile={rc}", "-q"], cwd=ROOT, check=True)
    out = folder / "coverage.json"
    subprocess.run(run + ["json", f"--rcfile={rc}", "-q", "-o", str(out)], cwd=ROOT, check=True)
    files = json.loads(out.read_text())["files"]
    figures = {}
    for package in (None,) + PACKAGES:
        covered = statements = 0
        for name, entry in files.items():
            rel = os.path.relpath(os.path.join(ROOT, name), ROOT)
            if package is None or rel.split(os.sep)[0] == package:
                covered += entry["summary"]["covered_lines"]
                statements += entry["summary"]["num_statements"]
        figures[package or "total"] = 100.0 * covered / statements if statements else 0.0
    return figures


def run_suite(label: str, extra: list[str], coverage: bool, log_to: Path | None = None) -> dict:
    """One run of ``python -m pytest EXTRA`` from the root: its counts, wall seconds and coverage."""
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        folder = Path(tmp)
        env = dict(os.environ)
        command = [sys.executable, "-m"]
        rc = None
        if coverage:
            rc = _coverage_rc(folder)
            env["COVERAGE_PROCESS_START"] = str(rc)  # xdist's workers and the CLI's subprocesses too
            command += ["coverage", "run", f"--rcfile={rc}", "-m"]
        command += ["pytest", "-q", "-p", "no:cacheprovider"] + extra
        if log_to is not None:
            log_to.mkdir(parents=True, exist_ok=True)
            env[LOG_ENV] = str(log_to)
            env["PYTHONPATH"] = str(ROOT / "benchmarks") + os.pathsep + env.get("PYTHONPATH", "")
            command += ["-p", "suite_times"]
        start, cpu, load = time.perf_counter(), _children_cpu(), os.getloadavg()[0]
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
        tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-300:]
        counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)",
                                                           tail)}
        failures = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        row = {"run": label, "wall_s": wall, "cpu_s": cpu, "failures": failures, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0)
               + counts.get("error", 0) + counts.get("errors", 0), "skipped": counts.get("skipped", 0),
               "exit": proc.returncode, "summary": tail, "load": (load, os.getloadavg()[0])}
        if coverage:
            row["coverage"] = _coverage_figures(rc, folder)
        return row


def _children_cpu() -> float:
    """CPU seconds of the processes this one has waited for (pytest, its workers, their subprocesses)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def format_rows(rows: list[dict]) -> str:
    """The table: tests run, failed, wall seconds, CPU seconds (what a loaded machine does not stretch: on an
    idle machine of N cores the wall time is about CPU / N at best), the load average as the run started and
    ended (1-minute), line coverage."""
    header = (f"{'run':<28} {'tests':>6} {'failed':>6} {'wall':>9} {'CPU':>9} {'load':>11}  {'coverage':>8}  "
              "by package")
    lines = [header, "-" * len(header)]
    for row in rows:
        cov = row.get("coverage")
        lines.append(f"{row['run']:<28} {row['passed'] + row['failed']:>6} {row['failed']:>6} "
                     f"{row['wall_s']:>8.0f}s {row['cpu_s']:>8.0f}s {_load(row):>11}  " + (f"{cov['total']:>7.1f}%  " + ", ".join(
                         f"{p} {cov[p]:.1f}%" for p in PACKAGES) if cov else f"{'-':>8}"))
    return "\n".join(lines)


def _load(row: dict) -> str:
    start, end = row.get("load", (None, None))
    return "-" if start is None else f"{start:.1f}-{end:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["fast", "whole", "serial"], action="append")
    parser.add_argument("--serial", action="store_true", help="also the whole suite in one process")
    parser.add_argument("--coverage", action="store_true", help="run under coverage.py: line coverage")
    parser.add_argument("--record", action="store_true", help="time every test; rewrite graph_tests/durations.json")
    parser.add_argument("--from-logs", type=Path, help="rewrite durations.json from a recorded run's logs")
    parser.add_argument("--budget", type=float, default=100.0,
                        help="recorded CPU seconds the fast subset may add up to (default 100: with collection and "
                        "the workers' start, under 2 minutes on 2 cores: 115 s measured on 2026-12-07)")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}")
    if args.from_logs is not None or args.record:
        folder = args.from_logs
        if args.record:
            folder = Path(tempfile.mkdtemp(prefix="suite-times-"))
            row = run_suite("whole suite (recording)", [], args.coverage, log_to=folder)
            print(format_rows([row]))
        cpu, wall = read_logs(folder)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        how = "benchmarks/suite.py --record" if args.record else f"benchmarks/suite.py --from-logs {folder}"
        data = write_record(cpu, wall, args.budget, f"{time.strftime('%Y-%m-%d')} at {commit}: {len(cpu)} tests, "
                            f"the CPU and wall seconds of each ({how}, load average {os.getloadavg()[0]:.1f})")
        fast = _fast_tests()(data["fast_seconds"], cpu, wall)
        print(f"wrote {DURATIONS.relative_to(ROOT)}: {len(cpu)} tests, {sum(cpu.values()):.0f} CPU s; fast "
              f"subset {len(fast)} tests (threshold {data['fast_seconds']} s and each file's cheapest), "
              f"{sum(cpu[n] for n in fast):.0f} CPU s")
        return 0
    runs = args.only or ["fast", "whole"] + (["serial"] if args.serial else [])
    rows = []
    for name in runs:
        extra = {"fast": ["-m", "fast"], "whole": [], "serial": ["-n", "0"]}[name]
        label = {"fast": "fast subset (-m fast)", "whole": "whole suite", "serial": "whole suite, serial (-n 0)"}[name]
        rows.append(run_suite(label, extra, args.coverage))
        print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_rows(rows))
    for row in rows:
        for line in row["failures"]:
            print(f"{row['run']}: {line}")
    by = {row["run"]: row for row in rows}
    whole = by.get("whole suite")
    for row in rows:
        if whole is not None and row is not whole:
            print(f"{row['run']}: {row['wall_s'] / whole['wall_s']:.2f} x the whole suite's time")
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else None
    if recorded is not None:
        print(f"durations record: {recorded['recorded']}")
    return 0 if all(row["exit"] in (0, 5) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
