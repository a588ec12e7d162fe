"""Every command that can run long shows a progress line on a terminal, and nothing extra otherwise.

Each command runs as a user runs it, its standard streams on a pseudo-terminal (``pty``), on a small
input: the progress line (``\\r<label>: ...``, redrawn in place and erased at the end) appears at the
first phase, so the runs stay short.  With ``--json``, or when the streams are not a terminal, the
output holds no progress line (the in-process ``--json`` checks give the CLI a stderr that says it is a
terminal, so only ``--json`` keeps it off).
"""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import time

import pytest
import yaml

from .cli_support import cli_env, console_command, relu_chain

FOUR_OPS = {
    "mesh": {"shape": [4], "names": ["tp"]},
    "inputs": {"x": {"shape": [8, 12], "placements": ["S(1)"], "requires_grad": False},
               "w1": {"shape": [12, 16], "placements": "auto"},
               "w2": {"shape": [16, 12], "placements": "auto"}},
    "nodes": [{"name": "h", "op": "matmul", "inputs": ["x", "w1"]},
              {"name": "a", "op": "gelu", "inputs": ["h"]},
              {"name": "y", "op": "matmul", "inputs": ["a", "w2"]}],
    "outputs": ["y"],
}


def _pipelined_llama() -> dict:
    """gen llama --full, 2 layers, float64, batch 2 on tp=2 with a pp=2 axis in front: 2 micro-batches."""
    from layout_prop.frontends.generate import llama_spec

    spec = llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=2, full=True, dtype="float64")
    return {**spec, "mesh": {"shape": [2] + list(spec["mesh"]["shape"]), "names": ["pp"] + list(spec["mesh"]["names"])},
            "inputs": {name: {**entry, "placements": ["R"] + list(entry["placements"])}
                       for name, entry in spec["inputs"].items()},
            "nodes": [{**node, "attrs": {**node["attrs"], "placements": ["R"] + list(node["attrs"]["placements"])}}
                      if "placements" in node.get("attrs", {}) else node for node in spec["nodes"]],
            "pipeline": {"axis": "pp", "micro_batches": 2}}


def _write(folder, name: str, spec: dict) -> str:
    path = folder / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def _on_a_terminal(args: list[str], cwd, timeout: float = 240.0) -> tuple[int, str]:
    """Run ``layout-prop ARGS`` with stdin, stdout and stderr on a new pseudo-terminal; its exit status and
    everything it wrote there (``\\r`` kept; the terminal's ``\\n`` -> ``\\r\\n`` undone)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(console_command() + args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
                            env=cli_env(), close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            pytest.fail(f"layout-prop {' '.join(args)} did not end within {timeout:.0f} s on a terminal")
        status = proc.wait(timeout=30)
    finally:
        os.close(master)
    return status, b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (for in-process runs of the CLI)."""

    def isatty(self) -> bool:
        return True


def _in_process(args: list[str], monkeypatch, capsys, terminal: bool) -> tuple[int, str, str]:
    """``cli.main(args)``: status, stdout, stderr; stderr a terminal when ``terminal``."""
    from layout_prop.cli import main

    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    status = main(args)
    return status, capsys.readouterr().out, err.getvalue()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("progress")
    paths = {"four": _write(folder, "four.yaml", FOUR_OPS), "pipe": _write(folder, "pipe.yaml", _pipelined_llama()),
             "chain": _write(folder, "chain.yaml", relu_chain(3))}
    from layout_prop.frontends.generate import gpt_spec

    paths["gpt"] = _write(folder, "gpt.yaml", gpt_spec(layers=2, mesh=(("dp", 2), ("sp", 1), ("tp", 1)), batch=2))
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths["onnx"] = os.path.join(here, "examples", "llama_block.onnx")
    paths["plan"] = os.path.join(here, "examples", "llama_plan.yaml")
    return folder, paths


#: (command line with {names} of the inputs, the progress label, a word of the result the command prints)
COMMANDS = [
    (["pipeline", "{pipe}", "--run"], "pipeline --run: ", "pipelined run on 4 ranks"),
    (["run", "{pipe}", "--backward"], "run: ", "matches one device"),
    (["run", "{chain}"], "run: ", "engine sim, 2 ranks"),
    (["plan", "{four}"], "plan: ", "w1"),
    (["plan", "{gpt}", "--search", "--cluster", "a100-80g", "--devices", "2", "--global-batch", "4", "--top", "1"],
     "plan --search: ", "configuration"),
    (["import", "{onnx}", "--plan", "{plan}", "-o", "imported.yaml"], "import: ", "wrote imported.yaml"),
]


@pytest.mark.parametrize("args, label, result", COMMANDS, ids=lambda v: v[0] if isinstance(v, list) else None)
def test_a_terminal_sees_progress_then_the_result(inputs, args, label, result):
    folder, paths = inputs
    status, text = _on_a_terminal([a.format(**paths) for a in args], folder)
    assert status == 0, text
    assert "\r" + label in text, text  # drawn in place
    assert result in text
    assert "Traceback" not in text
    assert text.count("\r" + label) >= 1 and text.rfind("\r" + label) < text.rfind(result), \
        "the progress line came after the result: it was not erased before printing"


@pytest.mark.parametrize("args", [a for a, _, _ in COMMANDS if a[0] != "import"],
                         ids=lambda v: " ".join(v[:2 if v[0] == "plan" and "--search" in v else 1]))
def test_json_on_a_terminal_has_no_progress(inputs, args, monkeypatch, capsys):
    folder, paths = inputs
    monkeypatch.chdir(folder)
    status, out, err = _in_process([a.format(**paths) for a in args] + ["--json"], monkeypatch, capsys,
                                   terminal=True)
    assert status == 0, err
    json.loads(out)
    assert "\r" not in out + err, err


def test_plain_output_to_a_pipe_has_no_progress(inputs, monkeypatch, capsys):
    folder, paths = inputs
    monkeypatch.chdir(folder)
    status, out, err = _in_process(["run", paths["chain"]], monkeypatch, capsys, terminal=False)
    assert status == 0, err
    assert "engine sim, 2 ranks" in out and "\r" not in out + err


def test_import_to_a_pipe_has_no_progress(inputs, monkeypatch, capsys):
    folder, paths = inputs
    monkeypatch.chdir(folder)
    status, out, err = _in_process(["import", paths["onnx"], "--plan", paths["plan"]], monkeypatch, capsys,
                                   terminal=False)
    assert status == 0, err
    assert out.startswith("mesh") or "nodes" in out
    assert "\r" not in out + err


def test_the_ticker_redraws_while_the_work_reports_nothing():
    """A call that says nothing for a while (a solver) still moves the line: the time is redrawn."""
    from layout_prop.io.progress import Ticker

    stream = _Terminal()
    with Ticker("plan", stream=stream, interval=0.05) as ticker:
        ticker.say("solving")
        time.sleep(0.3)
    drawn = [line for line in stream.getvalue().split("\r") if line.strip()]
    assert drawn[0] == "plan: solving, 0s" and len(drawn) >= 3, drawn
    assert stream.getvalue().endswith("\r")  # erased at the end
