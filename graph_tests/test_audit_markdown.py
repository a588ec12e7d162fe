"""docs/audit.md's per-op table and totals are what ``layout-prop audit ../shared/upstream/hyper-parallel
--markdown`` prints today (#36 item 4).

The whole audit of the snapshot runs once for this module (about 90 s of CPU: every op, meshes 4 and
2x2, 256 combinations per case and mesh), from the repository's root so that the relative path is the
page's; every test here reads that one run.  Skipped where the snapshot is missing (CI has it at
../shared/upstream/hyper-parallel, beside the checkout).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from layout_prop.cli import main

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT.parent / "shared" / "upstream" / "hyper-parallel"
PAGE = ROOT / "docs" / "audit.md"
COMMAND = "layout-prop audit ../shared/upstream/hyper-parallel --markdown"
pytestmark = pytest.mark.skipif(not (SNAPSHOT / "hyper_parallel" / "core" / "shard" / "ops").is_dir(),
                                reason=f"no hyper-parallel snapshot at {SNAPSHOT}")


@pytest.fixture(scope="module")
def printed():
    """(exit status, stdout) of the command, run once from the repository's root."""
    import contextlib
    import io
    import os

    out = io.StringIO()
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out):
            status = main(COMMAND.split()[1:])
    finally:
        os.chdir(here)
    return status, out.getvalue()


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| upstream op")]


def test_the_page_shows_what_the_command_prints(printed):
    status, out = printed
    page = PAGE.read_text(encoding="utf-8")
    block = re.search(rf"<!-- begin: {re.escape(COMMAND)} -->\n(.*?)\n<!-- end: {re.escape(COMMAND)} -->", page, re.S)
    assert block is not None, "docs/audit.md has no generated block"
    assert block.group(1).strip() == out.strip(), f"docs/audit.md is stale: paste the output of `{COMMAND}`"
    assert status == 1  # the snapshot has wrong answers


def test_every_snapshot_op_is_audited_and_the_total_row_adds_up(printed):
    """Every op of the snapshot runs in the worker without a failure; the total row is the sum of the rows."""
    _, out = printed
    rows = _rows(out)
    ops, total = rows[:-1], rows[-1]
    assert total[0] == f"**total ({len(ops)} ops)**" and len(ops) == 135
    assert all(row[2].isdigit() for row in ops), [row for row in ops if not row[2].isdigit()]  # no failure
    number = lambda text: int(text.replace(",", ""))  # noqa: E731
    assert number(total[2]) == sum(int(row[2]) for row in ops)
    assert total[4] == f"{sum(int(r[4].split()[0]) for r in ops):,} ({sum(int(r[4].split()[1][1:-1]) for r in ops):,})"
    for column in (3, 5, 6, 7):
        assert number(total[column]) == sum(int(row[column]) for row in ops)
    by_op = {row[0]: row for row in ops}
    assert by_op["Softmax"][4] == "0 (0)" and by_op["MatMul"][4] != "0 (0)"
    assert not out.splitlines()[-1].startswith(("Not audited", "Not mapped"))
