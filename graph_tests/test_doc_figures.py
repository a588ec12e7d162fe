"""Figures in docs/ that a command prints and that test_readme does not run (they need a spec the page
describes rather than writes out) are what the command prints today.

Pages whose figures are measurements (benchmarks, wall-clock times) say when and with which command they
were measured instead; the op reference (docs/ops.md) is checked by test_opref.py and the audit's table
by test_audit.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from layout_prop.cli import main
from layout_prop.workflows.pipeline import build, summary
from layout_prop.frontends.generate import gpt_spec, llama_spec
from layout_prop.io.loader import load_spec

from .transcripts import transcript_differences

PIPELINE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"


def _with_pipeline(spec: dict, stages: int, block: dict) -> dict:
    """``spec`` with a mesh axis ``pp`` of ``stages`` in front (every input R on it) and a ``pipeline:`` block."""
    inputs = {name: {**entry, "placements": ["R", *entry["placements"]]} for name, entry in spec["inputs"].items()}
    nodes = [{**node, "attrs": {**node["attrs"], "placements": ["R", *node["attrs"]["placements"]]}}
             if "placements" in node.get("attrs", {}) else node for node in spec["nodes"]]
    mesh = {"shape": [stages, *spec["mesh"]["shape"]], "names": ["pp", *spec["mesh"]["names"]]}
    return {**spec, "mesh": mesh, "inputs": inputs, "nodes": nodes, "pipeline": {"axis": "pp", **block}}


def _text_block(page: Path, command: str) -> str:
    """The output a page's ```text block shows under ``$ command``."""
    for block in re.findall(r"```text\n(.*?)```", page.read_text(), re.S):
        if block.startswith(f"$ {command}\n"):
            return block.partition("\n")[2]
    raise AssertionError(f"no ```text block of '$ {command}' in {page.name}")


def test_the_pipeline_command_prints_what_docs_pipeline_md_shows(tmp_path, capsys, monkeypatch):
    """docs/pipeline.md, "The command": ``layout-prop pipeline pipe.yaml`` on a 2-layer ``gen llama --full``
    (float64, batch 4, tp=2) with a pp=2 axis in front and ``pipeline: {axis: pp, micro_batches: 2}``.
    Its figures are the step-time model's (float64 arithmetic, no BLAS): exact."""
    spec = llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, full=True, dtype="float64")
    (tmp_path / "pipe.yaml").write_text(yaml.safe_dump(_with_pipeline(spec, 2, {"micro_batches": 2})))
    monkeypatch.chdir(tmp_path)
    assert main(["pipeline", "pipe.yaml"]) == 0
    printed = capsys.readouterr().out
    assert transcript_differences(_text_block(PIPELINE_PAGE, "layout-prop pipeline pipe.yaml"), printed) == [], (
        "docs/pipeline.md's `layout-prop pipeline pipe.yaml` block is stale; it now prints:\n" + printed)


def _tied_embedding_rows() -> dict[int, tuple[int, int, int, int]]:
    """docs/pipeline.md's table of a tied embedding's gradient: ``{tp: (messages, bytes) every micro-batch,
    then (messages, bytes) once a step}``."""
    rows = re.findall(r"^\| `tp=(\d+)` \| (\d+) messages, ([\d,]+) bytes .*?\| (\d+) messages, ([\d,]+) bytes \|$",
                      PIPELINE_PAGE.read_text(), re.M)
    return {int(tp): tuple(int(n.replace(",", "")) for n in figures) for tp, *figures in rows}


@pytest.mark.parametrize("tp", [1, 2])
def test_the_tied_embedding_table_of_docs_pipeline_md(tp):
    """The 4-layer ``gen gpt`` (hidden 32, vocabulary 64, float32, batch 8) on pp=2 with 8 micro-batches
    (1F1B): the moves of a step per rank, as ``pipeline`` lists them (``moves`` every micro-batch,
    ``step_moves`` once a step), and as they were when every move was sent every micro-batch."""
    rows = _tied_embedding_rows()
    assert sorted(rows) == [1, 2]
    spec = _with_pipeline(gpt_spec(layers=4, mesh=(("dp", 1), ("sp", 1), ("tp", tp)), batch=8, dtype="float32"),
                          2, {"micro_batches": 8, "schedule": "1f1b"})
    built = summary(build(load_spec(spec)))
    m = built["micro_batches"]
    every = [move["bytes_per_rank"] for move in built["moves"]]
    once = [move["bytes_per_rank"] for move in built["step_moves"]]
    assert m == 8 and len(once) == 1
    before = (m * (len(every) + len(once)), m * (sum(every) + sum(once)))
    after = (m * len(every) + len(once), m * sum(every) + sum(once))
    assert rows[tp] == before + after


SPEC_FORMAT_PAGE = Path(__file__).resolve().parents[1] / "docs" / "spec-format.md"


def test_the_conflicting_constraints_error_of_docs_spec_format_md(tmp_path, capsys, monkeypatch):
    """docs/spec-format.md's ``check pinned.yaml`` with constraints ``{"?": [R], y: ["S(0)"]}``: the page's
    pinned.yaml (its heredoc) with that constraints section; the one line it shows is what check prints."""
    written = re.search(r"^\$ cat > pinned.yaml <<'EOF'\n(.*?)^EOF$", SPEC_FORMAT_PAGE.read_text(), re.S | re.M)
    spec = yaml.safe_load(written.group(1))
    spec["constraints"] = {"?": ["R"], "y": ["S(0)"]}
    (tmp_path / "pinned.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)
    assert main(["check", "pinned.yaml"]) == 2
    shown = _text_block(SPEC_FORMAT_PAGE, 'layout-prop check pinned.yaml      # with constraints {"?": [R], y: ["S(0)"]}')
    assert transcript_differences(shown, capsys.readouterr().err) == []


def test_the_idle_share_docs_pipeline_md_quotes_is_the_estimates_transcript():
    """The sentence under ``estimate chain.yaml`` quotes its idle share; the transcript itself is checked
    against the command by test_readme, so the sentence is held to the transcript."""
    page = PIPELINE_PAGE.read_text()
    printed = re.findall(r"the busiest stage idles ([\d.]+) of its busy time, the closed form's bubble", page)
    quoted = re.findall(r"the\s+busiest\s+stage\s+idles\s+([\d.]+)\s+of\s+its\s+busy\s+time\s+where\s+the\s+closed",
                        page)
    assert len(printed) == 1 and quoted == printed
