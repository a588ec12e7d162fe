"""Records of the RotaryPositionEmbedding and elementwise ops."""

from . import OpRecord, OpSample

RECORDS = [
    OpRecord("rotary_position_embedding", [
        OpSample([(3, 2, 5, 8), (1, 1, 5, 8), (1, 1, 5, 8)], {"mode": 0}),
        OpSample([(2, 3, 4, 4), (2, 3, 4, 4), (2, 3, 4, 4)], {"mode": 2}),
        OpSample([(5, 1, 3, 6), (1, 3, 6), (1, 3, 6)], {"mode": 1}),
        OpSample([(4, 2, 8), (4, 1, 8), (4, 1, 8)], {"mode": 3, "input_layout": "TND"}),
    ], placements=120, id="rpe"),
    OpRecord("add", [OpSample([(4, 3), (3,)]), OpSample([(5, 1, 3), (5, 2, 3)]), OpSample([(3, 4), (3, 4)])],
             placements=150),
    OpRecord("sub", [OpSample([(4, 3), (4, 3)]), OpSample([(1, 3), (5, 3)])], placements=150),
    OpRecord("mul", [OpSample([(4, 3), (3,)]), OpSample([(3, 5, 2), (3, 5, 2)])], placements=150),
    OpRecord("neg", [OpSample([(5, 3)]), OpSample([(2, 3, 4)])], placements="all"),
    OpRecord("identity", [OpSample([(5, 3)])], placements="all"),
]
