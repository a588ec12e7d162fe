"""The generic op test: every record of the op database through the testing kit.

For each placement combination: either a documented violation code, or forward and
backward agreement of propagate + (reshard +) lower + simulate with one device.
"""

from __future__ import annotations

import pytest

from layout_prop.testing import Report, verify_op

from layout_prop.testing.opdb import all_records

RECORDS = all_records()
TOTAL = Report("all")
DONE: set[int] = set()


@pytest.mark.parametrize("record", RECORDS, ids=[r.name for r in RECORDS])
def test_op_record(record):
    report = verify_op(record.op, record.samples, meshes=record.meshes, placements=record.placements,
                       backward=record.backward, codes=record.codes, seed=len(record.name))
    TOTAL.merge(report)
    DONE.add(id(record))
    print(f"{record.name}: {report.to_dict() | {'mismatches': len(report.mismatches)}}")
    assert not report.undocumented, report.to_dict()["undocumented"]
    assert not report.unfixed, report.unfixed[0]
    assert not report.mismatches, report.mismatches[0].message + f"\nspec: {report.mismatches[0].spec}"
    assert report.accepted + report.resharded > 0, "no combination was checked numerically"


def test_op_database_total_is_large_enough():
    # runs after the records (pytest keeps file order); counts combinations verified numerically or rejected
    verified = TOTAL.accepted + TOTAL.resharded
    print(f"op database: {TOTAL.combinations} combinations, {TOTAL.accepted} accepted, {TOTAL.resharded} resharded "
          f"and verified, rejected {TOTAL.rejected}, unusable {TOTAL.unusable}")
    if len(DONE) < len(RECORDS):
        pytest.skip("counts only when every record ran in this session (pytest keeps file order)")
    assert TOTAL.combinations > 10_000 and verified > 0
