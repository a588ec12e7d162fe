"""The planner's limits: mesh links within bounds (every time figure finite), a memory limit
honoured as measured and reported as given, and one grammar for the memory-size flags."""

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.cli import main
from layout_prop.commands.flags import memory_size_arg as _memory_size
from layout_prop.core.errors import SpecError
from layout_prop.io.loader import load_spec
from layout_prop.workflows.plan import parse_bytes, plan_spec
from layout_prop.io.sizes import GRAMMAR, MAX_BYTES, UNITS, parse_size

#: the limits table (docs/violation-codes.md) states the size grammar
LIMITS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "violation-codes.md"

# the audit's spec: two matmuls on a 2 x 2 mesh, the weights to plan
AUTO = """
mesh: {shape: [2, 2], names: [dp, tp]LINKS}
inputs:
  x: {shape: [4, 8], placements: ["S(0)", R], requires_grad: false}
  w: {shape: [8, 16], placements: auto}
  w2: {shape: [16, 8], placements: auto}
nodes:
  - {name: h, op: matmul, inputs: [x, w]}
  - {name: y, op: matmul, inputs: [h, w2]}
outputs: [y]
"""


def _spec(tmp_path, links=None):
    path = tmp_path / "auto.yaml"
    path.write_text(AUTO.replace("LINKS", f", links: {links}" if links else ""))
    return path


def _strict_json(text):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- F15: one size grammar
SIZES = [("4096", 4096), ("3MB", 3_000_000), ("3mb", 3_000_000), ("3MiB", 3 * 2 ** 20), ("3M", 3 * 2 ** 20),
         ("512M", 512 * 2 ** 20), ("8G", 8 * 2 ** 30), ("1.5T", 3 * 2 ** 39), ("1P", 2 ** 50), ("1024P", 2 ** 60),
         ("1PiB", 2 ** 50), ("1pb", 10 ** 15), ("64KB", 64_000), ("64k", 65_536), (" 2 GiB ", 2 ** 31),
         (".5KiB", 512), ("1.5 KB", 1500), ("10B", 10), ("1.9", 1)]


@pytest.mark.parametrize("text, size", SIZES)
def test_both_flags_read_a_size_alike(text, size):
    assert _memory_size(text) == parse_bytes(text) == parse_size(text) == size


BAD_SIZES = [("0", "is not positive: it is zero"), ("0KiB", "is not positive: it is zero"),
             ("-1", "is not positive: it is negative"), ("-5G", "is not positive: it is negative"),
             ("0.5", "less than one byte"), ("0.0001KB", "less than one byte"),
             ("inf", "is not a finite number"), ("NaN", "is not a finite number"), ("-Infinity", "not a finite"),
             ("1e9", "has an exponent"), ("1025P", "over the limit 1152921504606846976 bytes"),
             ("9" * 400, "over the limit"), ("1Q", "unknown unit 'Q'"), ("PiB", "is not a size like"),
             ("", "is not a size like"), ("+5", "has a sign")]


@pytest.mark.parametrize("text, problem", BAD_SIZES)
def test_bad_sizes_are_one_line_with_the_flag_the_value_and_the_grammar(tmp_path, capsys, text, problem):
    path = _spec(tmp_path)
    for argv, head in ((["run", str(path), f"--max-memory={text}"], "bad-usage: argument --max-memory: size"),
                       (["plan", str(path), f"--memory-per-rank={text}"],
                        "bad-value: memory per rank (--memory-per-rank)")):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        line = _one_line(err)
        assert out == "" and head in line and problem in line and f"(hint: {GRAMMAR})" in line, line
        assert repr(text)[:20] in line or "..." in line, line


_NUMBERS = st.one_of(st.integers(0, 10 ** 20).map(str),
                     st.tuples(st.integers(0, 10 ** 6), st.text("0123456789", max_size=70))
                     .map(lambda t: f"{t[0]}.{t[1]}"))


@settings(max_examples=300, deadline=None)
@given(_NUMBERS, st.sampled_from(sorted(UNITS)), st.sampled_from([str.lower, str.upper, str.title]),
       st.sampled_from(["", " "]))
def test_the_grammar_is_exact(number, unit, case, space):
    text = f"{number}{space}{case(unit)}"
    value = Fraction(number) * UNITS[unit]
    if value == 0 or int(value) < 1 or int(value) > MAX_BYTES:
        for parse in (parse_size, parse_bytes):
            with pytest.raises(SpecError):
                parse(text)
        with pytest.raises(SpecError) as err:
            _memory_size(text)
        assert err.value.code == "bad-usage" and err.value.hint == GRAMMAR
    else:
        assert _memory_size(text) == parse_bytes(text) == int(value)


def _flat(text):
    return re.sub(r"\s+", "", text)


def test_the_readme_and_both_helps_state_the_same_grammar(capsys):
    for command in ("run", "plan"):
        assert main([command, "--help"]) == 0
        assert _flat(GRAMMAR) in _flat(capsys.readouterr().out), command
    limits = LIMITS_PAGE.read_text()
    assert _flat(GRAMMAR) in _flat(limits)
    assert "| `--max-memory`, `--memory-per-rank` | at most 2^60 bytes (`1024P`)" in limits


# ----------------------------------------------------------------------------- F2: links
@pytest.mark.parametrize("links, where, shown", [
    ("{dp: {GBps: 1e-320}, tp: {GBps: 1e-320}}", "mesh.links.dp.GBps", "1e-320"),
    ("{dp: {GBps: 1e-300, latency_us: 1e300}}", "mesh.links.dp.GBps", "1e-300"),
    ("{tp: {latency_us: 1e300}}", "mesh.links.tp.latency_us", "1e+300"),
    ("{tp: {GBps: 1e7}}", "mesh.links.tp.GBps", "10000000.0"),
    ("{tp: {GBps: 1" + "0" * 400 + "}}", "mesh.links.tp.GBps", "<an integer of"),
    ("{tp: {GBps: .nan}}", "mesh.links.tp.GBps", "nan"),
    ("{tp: {latency_us: -1}}", "mesh.links.tp.latency_us", "-1"),
])
@pytest.mark.parametrize("command", [["plan", "--json"], ["plan", "--objective", "time"], ["check"]])
def test_links_whose_costs_are_not_finite_floats_are_refused(tmp_path, capsys, links, where, shown, command):
    path = _spec(tmp_path, links)
    assert main([command[0], str(path), *command[1:]]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == "" and f"bad-value at {where}:" in line and shown in line, line
    assert "GBps is a number in [1e-06, 1e+06]" in line and "latency_us one in [0, 1e+09]" in line, line


@pytest.mark.parametrize("links", ["{dp: {GBps: 1e-6, latency_us: 1e9}, tp: {GBps: 1e-6, latency_us: 1e9}}",
                                   "{dp: {GBps: 1e6, latency_us: 0}, tp: {GBps: 1e-6, latency_us: 0}}"])
@pytest.mark.parametrize("objective", ["bytes", "time"])
def test_links_at_the_bounds_give_finite_times(tmp_path, capsys, links, objective):
    path = _spec(tmp_path, links)
    assert main(["plan", str(path), "--objective", objective, "--json"]) == 0
    data = _strict_json(capsys.readouterr().out)
    for figure in (data["plan"]["time_us_per_step"], data["baseline"]["time_us_per_step"],
                   data["solver"]["modelled_cost"]):
        assert isinstance(figure, float) and math.isfinite(figure)


# ----------------------------------------------------------------------------- F6: the memory limit
@pytest.mark.parametrize("given, limit", [("672", 672), ("1KB", 1000), ("1100", 1100), ("1KiB", 1024)])
def test_a_limit_no_plan_fits_is_reported_as_given(tmp_path, capsys, given, limit):
    path = _spec(tmp_path)
    assert main(["plan", str(path), "--memory-per-rank", given, "--json"]) == 1
    data = _strict_json(capsys.readouterr().out)
    assert data["ok"] is False and data["error"] == "memory-limit"
    assert data["memory_limit"] == limit and data["least_memory_per_rank"] > limit
    assert f"({limit} bytes)" in data["message"] or f"{limit} bytes per rank" in data["message"]
    assert main(["plan", str(path), "--memory-per-rank", given]) == 1
    err = _one_line(capsys.readouterr().err)
    least = int(re.search(r"raise --memory-per-rank to at least (\d+)", err).group(1))
    assert least == data["least_memory_per_rank"] and f"{limit} bytes" in err


def test_the_least_memory_named_is_a_plan_that_fits(tmp_path, capsys):
    path = _spec(tmp_path)
    assert main(["plan", str(path), "--memory-per-rank", "1100", "--json"]) == 1
    least = _strict_json(capsys.readouterr().out)["least_memory_per_rank"]
    assert main(["plan", str(path), "--memory-per-rank", str(least), "--json"]) == 0
    data = _strict_json(capsys.readouterr().out)
    assert data["ok"] and data["plan"]["memory_per_rank"]["total"] <= least
    assert main(["plan", str(path), "--memory-per-rank", str(least - 1)]) == 1


@pytest.mark.parametrize("limit", [700, 1100, 1152, 1200, 1500, 2000, 4000])
def test_a_plan_reported_holds_at_most_the_limit_as_measured(tmp_path, limit):
    graph = load_spec(_spec(tmp_path))
    try:
        report = plan_spec(graph, memory_limit=limit)
    except SpecError:
        raise
    except Exception as err:  # InfeasiblePlan: the user's limit, and a least memory above it
        assert err.code == "memory-limit" and err.limit == limit and err.least > limit and err.measured
        return
    assert report.plan["ok"] and report.plan["memory_per_rank"]["total"] <= limit


def test_a_solver_stopped_before_any_bound_still_prints_strict_json(tmp_path, capsys, monkeypatch):
    from layout_prop.planner.solver import Problem

    solve = Problem.solve

    def stopped(self, *args, **kwargs):  # as HiGHS stopped by its time limit with no dual bound: gap inf
        found = solve(self, *args, **kwargs)
        self.optimal, self.gap = False, math.inf
        return found

    monkeypatch.setattr(Problem, "solve", stopped)
    path = _spec(tmp_path)
    assert main(["plan", str(path), "--json"]) == 0
    data = _strict_json(capsys.readouterr().out)
    assert data["solver"]["optimal"] is False and data["solver"]["gap"] is None
    assert any("no bound proven yet" in note for note in data["notes"])
    assert main(["plan", str(path)]) == 0
    assert "not proven optimal" in capsys.readouterr().out
