"""Records of the loss family: cross_entropy, cross_entropy_parts, dropout.

The kit's random integer targets lie in [0, 8): every sample has at least 8 classes, and
an ``ignore_index`` in that range checks ignored tokens.  Uneven dims: 5 tokens or 9
classes on 2 or 4 pieces (9 on 4 gives 3, 3, 3, 0: a rank without classes); size-1
token dims.  ``cross_entropy_combine`` takes the parts of a real cross entropy (a sum
of exponentials must be positive): ``graph_tests/test_loss_ops.py`` checks the
three-node vocab-parallel form instead of random parts, and ``multinomial`` (whose
weights must be non-negative, which the kit's normal data is not) after an ``exp``.
"""

from . import OpRecord, OpSample

CE = dict(dtypes=["float32", "int64"], requires_grad=[True, False])
PARTS = dict(dtypes=["float32", "int64", "float32"], requires_grad=[True, False, True])
MESHES = ((4,), (2, 2))

RECORDS = [
    OpRecord("cross_entropy", [
        OpSample([(5, 9), (5,)], **CE),
        OpSample([(2, 3, 8), (2, 3)], {"reduction": "sum", "ignore_index": 3, "label_smoothing": 0.1}, **CE),
        OpSample([(1, 9), (1,)], {"reduction": "none"}, **CE),
        OpSample([(3, 1, 8), (3, 1)], {"ignore_index": 0, "label_smoothing": 0.25}, **CE),
    ], meshes=MESHES, placements=40, id="loss-cross_entropy"),
    OpRecord("cross_entropy_parts", [
        OpSample([(5, 9), (5,), (5,)], **PARTS),
        OpSample([(2, 3, 8), (2, 3), (2, 3)], {"ignore_index": 3}, **PARTS),
    ], meshes=MESHES, placements=40, id="loss-cross_entropy_parts"),
]
RECORDS += [
    OpRecord("dropout", [
        OpSample([(5, 4, 3)], {"p": 0.3, "seed": 7}),
        OpSample([(1, 9)], {"p": 0.5}),
        OpSample([(4, 6)], {"p": 0.2, "training": False}),
    ], meshes=MESHES, placements=40, id="loss-dropout"),
]

# the grad ops on their own (their forward ops' records reach them through --backward too)
GRAD = dict(requires_grad=[False, False, False, False])
RECORDS += [
    OpRecord("cross_entropy_grad", [
        OpSample([(), (5, 9), (5,)], dtypes=["float32", "float32", "int64"], **GRAD),
        OpSample([(2, 3), (2, 3, 8), (2, 3)], {"reduction": "none", "label_smoothing": 0.2},
                 dtypes=["float32", "float32", "int64"], **GRAD),
    ], meshes=MESHES, placements=20, backward=False, id="loss-cross_entropy_grad"),
    OpRecord("cross_entropy_parts_grad", [
        OpSample([(5, 3), (5, 9), (5,), (5,)], dtypes=["float32", "float32", "int64", "float32"], **GRAD),
    ], meshes=MESHES, placements=20, backward=False, id="loss-cross_entropy_parts_grad"),
    OpRecord("cross_entropy_combine_grad", [
        OpSample([(), (5, 3), (5,)], {"num_classes": 9}, dtypes=["float32", "float32", "int64"], **GRAD),
        OpSample([(5,), (5, 3), (5,)], {"num_classes": 8, "reduction": "none"},
                 dtypes=["float32", "float32", "int64"], **GRAD),
    ], meshes=MESHES, placements=20, backward=False, id="loss-cross_entropy_combine_grad"),
    # integer weights: the kit draws them in [0, 8), non-negative as multinomial needs (normal floats are not)
    OpRecord("multinomial", [
        OpSample([(5, 9)], {"num_samples": 3}, dtypes=["int64"], requires_grad=[False]),
        OpSample([(6, 8)], {"num_samples": 6, "replacement": True, "seed": 3}, dtypes=["int64"],
                 requires_grad=[False]),
    ], meshes=MESHES, placements=30, backward=False, id="loss-multinomial"),
]
