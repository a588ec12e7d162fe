"""The generic op test: every record of the op database through the testing kit.

For each placement combination: either a documented violation code, or forward and
backward agreement of propagate + (reshard +) lower + simulate with one device.

The records are most of the suite's time, so they are dealt over this file and
``test_opdb_1.py`` .. ``test_opdb_3.py`` (record ``i`` in part ``i % 4``): pytest-xdist gives
each file to one worker (``--dist loadfile``), and the parts keep both cores busy.
"""

from __future__ import annotations

import pytest

from layout_prop.testing import combination_specs, verify_op

from layout_prop.testing.opdb import all_records

RECORDS = all_records()
#: the files the records are dealt over (this one is part 0)
PARTS = 4


def records_of(part: int) -> list:
    """The records of ``part`` (0 .. PARTS - 1): every PARTS-th, so each part gets some of every family."""
    return RECORDS[part::PARTS]


def check_record(record) -> None:
    """Every placement combination of ``record`` is right or rejected with a documented code."""
    report = verify_op(record.op, record.samples, meshes=record.meshes, placements=record.placements,
                       backward=record.backward, codes=record.codes, seed=len(record.name))
    print(f"{record.name}: {report.to_dict() | {'mismatches': len(report.mismatches)}}")
    assert not report.undocumented, report.to_dict()["undocumented"]
    assert not report.unfixed, report.unfixed[0]
    assert not report.mismatches, report.mismatches[0].message + f"\nspec: {report.mismatches[0].spec}"
    assert report.accepted + report.resharded > 0, "no combination was checked numerically"


@pytest.mark.parametrize("record", records_of(0), ids=[r.name for r in records_of(0)])
def test_op_record(record):
    check_record(record)


def test_op_database_total_is_large_enough():
    """The database tries over 10,000 combinations (counted as verify_op draws them, without running them:
    each record's test checks its own numerically)."""
    total = sum(len(combination_specs(r.op, r.samples, meshes=r.meshes, placements=r.placements, seed=len(r.name)))
                for r in RECORDS)
    print(f"op database: {len(RECORDS)} records, {total} combinations")
    assert total > 10_000


def test_the_parts_hold_every_record_once():
    assert sorted(r.name for part in range(PARTS) for r in records_of(part)) == sorted(r.name for r in RECORDS)
