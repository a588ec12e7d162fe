"""Records of the RotaryPositionEmbedding and elementwise ops (their samples live on the rules)."""

from layout_prop.core.registry import get_rule

from . import OpRecord

RECORDS = [
    OpRecord("rotary_position_embedding", get_rule("rope").sample_inputs(), placements=120, id="rpe"),
    OpRecord("add", get_rule("add").sample_inputs(), placements=150),
    OpRecord("sub", get_rule("sub").sample_inputs(), placements=150),
    OpRecord("mul", get_rule("mul").sample_inputs(), placements=150),
    OpRecord("neg", get_rule("neg").sample_inputs(), placements="all"),
    OpRecord("identity", get_rule("identity").sample_inputs(), placements="all"),
]
