"""Records of the copying family: expand, stack, unbind (and unbind2/unbind3), full_like and its subclasses, pad,
repeat_interleave.

Uneven dims (5 on 2 or 4 pieces), size-1 dims (expanded ones among them), an empty
output piece, crops (negative pads) and zero repeats.
"""

from layout_prop.core.registry import get_rule

from . import OpRecord, OpSample

MESHES = ((4,), (2, 2))

RECORDS = [
    OpRecord("expand", [
        OpSample([(5, 1, 3)], {"shape": [2, 5, 4, 3]}),
        OpSample([(1, 6)], {"shape": [5, -1]}),
        OpSample([(3,)], {"shape": [1, 3]}),
    ], meshes=MESHES, placements=40, id="copying-expand"),
    OpRecord("stack", [
        OpSample([(5, 3), (5, 3)], {"dim": 1}),
        OpSample([(2, 1), (2, 1), (2, 1)], {"dim": -1}),
        OpSample([(7,), (7,)]),
    ], meshes=MESHES, placements=40, id="copying-stack"),
    OpRecord("unbind2", [
        OpSample([(5, 2, 3)], {"dim": 1}),
        OpSample([(2, 7)]),
    ], meshes=MESHES, placements=40, id="copying-unbind2"),
    OpRecord("unbind3", [
        OpSample([(3, 5)], {"dim": 0}),
    ], meshes=MESHES, placements=30, id="copying-unbind3"),
    OpRecord("full_like", [
        OpSample([(5, 3)], {"fill_value": 2.5}),
        OpSample([(4, 1)], {"fill_value": 3, "dtype": "int64"}),
        OpSample([(5, 3)], {"fill_value": -1.0, "shape": [2, 7]}),
    ], meshes=MESHES, placements=30, backward=False, id="copying-full_like"),
    OpRecord("zeros_like", [OpSample([(5, 2)])], meshes=MESHES, placements=20, backward=False,
             id="copying-zeros_like"),
    OpRecord("ones_like", [OpSample([(3, 5)])], meshes=MESHES, placements=20, backward=False,
             id="copying-ones_like"),
    OpRecord("new_ones", [OpSample([(3, 5)], {"shape": [4]})], meshes=MESHES, placements=20, backward=False,
             id="copying-new_ones"),
    OpRecord("pad", [
        OpSample([(5, 3)], {"pad": [1, 2]}),
        OpSample([(5, 6, 3)], {"pad": [0, 0, -2, 1], "value": 1.5}),
        OpSample([(1, 5)], {"pad": [-1, -1, 2, 0]}),
    ], meshes=MESHES, placements=40, id="copying-pad"),
    OpRecord("repeat_interleave", [
        OpSample([(5, 3)], {"repeats": 2, "dim": 0}),
        OpSample([(4, 3)], {"repeats": 3, "dim": 0}),
        OpSample([(2, 4)], {"repeats": [1, 0, 2, 3], "dim": 1}),
        OpSample([(2, 3)], {"repeats": 2}),
        OpSample([(4, 2, 3)], {"repeats": 2}),  # flattened: rows 1 each on 4 ranks stay sharded
        OpSample([(5, 2)], {"repeats": 3}),  # flattened: 2, 2, 1, 0 rows repeated are not the output's chunks
    ], meshes=MESHES, placements=40, id="copying-repeat_interleave"),
]
RECORDS += [
    OpRecord("repeat_interleave_grad", [
        OpSample([(10, 3)], {"repeats": 2, "dim": 0, "shape": [5, 3]}, requires_grad=[False]),
        OpSample([(2, 6)], {"repeats": [1, 0, 2, 3], "dim": 1, "shape": [2, 4]}, requires_grad=[False]),
        OpSample([(48,)], {"repeats": 2, "shape": [4, 2, 3]}, requires_grad=[False]),
    ], meshes=MESHES, placements=20, backward=False, id="copying-repeat_interleave_grad"),
]
RECORDS += [
    OpRecord("unbind", get_rule("unbind").sample_inputs(), meshes=MESHES, placements=40, id="copying-unbind"),
]
