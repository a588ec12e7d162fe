"""``layout-prop verify`` at scale: counts that add up, strict JSON, several processes, progress."""

import io
import json
import subprocess
import sys

import pytest

from layout_prop.cli import main
from layout_prop.io.progress import Progress
from layout_prop.testing import combination_specs, verify_op


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("op, meshes", [("add", [(2,), (2, 2)]), ("rms_norm", [(2, 2)]), ("reshape", [(2,)])])
def test_every_combination_is_counted_once(op, meshes):
    report = verify_op(op, meshes=meshes, placements=40, backward=False)
    assert report.combinations == len(combination_specs(op, meshes=meshes, placements=40))
    assert (report.accepted + report.resharded + report.refused + report.unusable + len(report.unfixed)
            == report.combinations)
    # every code of a rejected combination is counted either as fixed or as refused
    for code, n in report.rejected.items():
        assert report.fixed.get(code, 0) + report.refused_codes.get(code, 0) == n


def test_jobs_give_the_same_report_as_one_process():
    one = verify_op("mul", meshes=[(2,), (2, 2)], placements=60, backward=True)
    two = verify_op("mul", meshes=[(2,), (2, 2)], placements=60, backward=True, jobs=2)
    assert one.combinations > 80 and one.to_dict() == two.to_dict()


def test_verify_json_is_strict_when_a_kernel_returns_nan(tmp_path):
    module = tmp_path / "nan_op.py"
    module.write_text('''
import numpy as np
from layout_prop import OpRule, RuleResult, register_kernel, register_op
from layout_prop.testing import OpSample

@register_op
class NanOnShards(OpRule):
    name = "user_nan_on_shards"
    operands = ("x",)

    def infer_layout(self, inputs, attrs):
        return RuleResult((inputs[0],))

    def sample_inputs(self):
        return [OpSample([(4, 2)], partial_ok=False)]

register_kernel("user_nan_on_shards", lambda x: np.full_like(x, np.nan) if x.shape[0] < 4 else x.copy())
''')
    done = subprocess.run([sys.executable, "-m", "layout_prop.cli", "verify", "user_nan_on_shards", "--module",
                           str(module), "--mesh", "2", "--json"], capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    data = _strict(done.stdout)  # no NaN, no Infinity
    assert data["mismatches"] and data["mismatches"][0]["max_abs_err"] is None
    assert done.stderr == ""  # --json: no progress, no advice


def test_verify_text_counts_add_up(capsys):
    assert main(["verify", "add", "--mesh", "2", "--samples", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    total = int(lines[0].split(": ")[1].split()[0])
    counts = [int(line.split(": ")[1].split()[0]) for line in lines[1:4]]
    assert lines[2].startswith("  rejected, then fixed by --reshard") and sum(counts) == total


def test_large_enumeration_prints_advice_first_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr("layout_prop.commands.verify.VERIFY_ADVICE_THRESHOLD", 1)
    assert main(["verify", "neg", "--mesh", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--samples N" in err[0] and "--jobs N" in err[0]


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_terminal_and_erases_itself():
    stream = _Tty()
    bar = Progress(200, "verify add", stream=stream, interval=0.0)
    bar.update(50)
    assert "verify add: 50/200 (25%)" in stream.getvalue() and "left" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r")


def test_progress_under_the_command_lines_escaping_stderr_keeps_its_carriage_return():
    """The CLI wraps stderr to escape control characters: the line must still redraw in place
    (a raw \\r), while a control character in a user's name is escaped."""
    from layout_prop.cli import _Printable

    stream = _Tty()
    bar = Progress(0, "verify \x1b[31mop", stream=_Printable(stream), interval=0.0)
    bar.show("2 ranks: 1 joined")
    assert stream.getvalue() == "\rverify \\x1b[31mop: 2 ranks: 1 joined"


def test_progress_is_silent_on_pipes_and_files():
    stream = io.StringIO()
    with Progress(10, "x", stream=stream, interval=0.0) as bar:
        for i in range(10):
            bar.update(i + 1)
    assert stream.getvalue() == ""


def test_a_mistyped_flag_suggests_the_right_one(capsys):
    assert main(["check", "examples/rpe/dp_sp.yaml", "--reshrad"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reshrad" in err and "did you mean --reshard?" in err
    assert main(["chek", "x.yaml"]) == 2
    assert "did you mean 'check'?" in capsys.readouterr().err
    assert main(["run", "x.yaml", "--engine", "simm"]) == 2
    assert "did you mean 'sim'?" in capsys.readouterr().err


def test_run_no_reshard_with_violations_says_nothing_ran(capsys):
    from pathlib import Path

    spec = str(Path(__file__).resolve().parent.parent / "examples" / "llama_block.yaml")
    assert main(["run", spec, "--no-reshard"]) == 1
    out = capsys.readouterr().out
    assert "nothing was executed" in out and "match one device" not in out and "MISMATCH" not in out
    assert main(["run", spec, "--no-reshard", "--json"]) == 1
    data = _strict(capsys.readouterr().out)
    assert data["executed"] is False and data["mismatches"] == [] and data["violations"]


def test_json_output_is_one_line_on_a_pipe_and_strict():
    from pathlib import Path

    spec = str(Path(__file__).resolve().parent.parent / "examples" / "rpe" / "dp_sp.yaml")
    done = subprocess.run([sys.executable, "-m", "layout_prop.cli", "check", spec, "--json"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.count("\n") == 1
    assert _strict(done.stdout)["tensors"]["y"]["placements"] == ["S(0)", "S(2)"]


def test_non_finite_numbers_are_written_as_null(capsys):
    from layout_prop.commands.printing import print_json

    print_json({"a": float("nan"), "b": [1.5, float("-inf")], "c": {"d": float("inf")}})
    assert _strict(capsys.readouterr().out) == {"a": None, "b": [1.5, None], "c": {"d": None}}


def test_check_does_not_import_networkx_matplotlib_or_mindspore():
    from pathlib import Path

    spec = str(Path(__file__).resolve().parent.parent / "examples" / "llama_block.yaml")
    code = ("import sys; from layout_prop.cli import main; main(['check', %r, '--reshard', '--json']); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'networkx', 'matplotlib', 'mindspore'}))" % spec)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_run_with_an_unfixable_violation_does_not_blame_no_reshard(tmp_path, capsys):
    spec = tmp_path / "bad_mode.yaml"
    spec.write_text("mesh: {shape: [2], names: [dp]}\ninputs:\n  x: {shape: [2, 2, 4, 8]}\n"
                    "  cos: {shape: [1, 1, 4, 8]}\n  sin: {shape: [1, 1, 4, 8]}\n"
                    "nodes:\n  - {name: y, op: rope, inputs: [x, cos, sin], attrs: {mode: 7}}\n")
    assert main(["run", str(spec)]) == 1
    out = capsys.readouterr().out
    assert "nothing was executed: 1 violation(s) that no redistribution fixes" in out and "--no-reshard" not in out
