"""Records of the shape ops: reshape, transpose, split/chunk variants, slice, pad_slice, concat, unsqueeze, squeeze.

The samples live on the rules (``sample_inputs``, so ``layout-prop verify reshape`` uses
them too); each op's samples mix even dims, uneven ones (B = 3 merged on 2 ranks, 5 rows
cut in 2 chunks) and size-1 dims.  Single-operand ops try every placement combination
(at most 5 choices per mesh axis); concat, with up to three operands, a
seeded sample.  ``split`` and ``chunk`` (torch's, their output count worked out from the
attrs and the shape) try one to seven outputs.  The split/chunk variants share one rule class each; N = 2, 3, 4 and 8
stand for the rest (5..7 differ only in ``num_outputs``).
"""

from layout_prop.ops.shape import SPLIT_VARIANTS
from layout_prop.core.registry import get_rule

from . import OpRecord


def _record(op: str, placements="all") -> OpRecord:
    return OpRecord(op, get_rule(op).sample_inputs(), placements=placements, id=f"shape-{op}")


RECORDS = [
    _record("reshape"),
    _record("transpose"),
    *[_record(name) for name in SPLIT_VARIANTS if int(name[5:]) in (2, 3, 4, 8)],
    _record("split", placements=25),
    _record("chunk", placements=25),
    _record("slice"),
    _record("pad_slice"),
    _record("concat", placements=300),
    _record("unsqueeze"),
    _record("squeeze"),
]
