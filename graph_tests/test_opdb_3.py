"""Part 3 of the op database's records (graph_tests/test_opdb.py says why they are dealt over files)."""

from __future__ import annotations

import pytest

from . import test_opdb as opdb


@pytest.mark.parametrize("record", opdb.records_of(3), ids=[r.name for r in opdb.records_of(3)])
def test_op_record(record):
    opdb.check_record(record)
