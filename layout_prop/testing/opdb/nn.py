"""Records of the nn ops: norms, softmax, attention, SwiGLU, activations, and their grad ops.

Each record mixes even, uneven (5 on 2 devices) and size-1 dims.  The grad ops have
records of their own so that a Partial cotangent ``dy`` (which the backward pass never
produces from a one-op graph) is tried too.  Random placements mostly hold a Partial
somewhere, so one sample of the attention and norm records leaves Partial out to try
more layouts that are accepted as they are.
"""

from . import OpRecord, OpSample

_ATTENTION = [
    OpSample([(2, 2, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4)], {"causal": True}),
    OpSample([(2, 3, 5, 4), (2, 3, 3, 4), (2, 3, 3, 2)], {"causal": False}),
    OpSample([(3, 5, 2, 4), (3, 5, 2, 4), (3, 5, 2, 4)], {"layout": "BSND", "causal": True}, partial_ok=False),
    OpSample([(1, 2, 3, 4), (1, 2, 6, 4), (1, 2, 6, 4)], {"causal": True, "scale": 0.3}),
    OpSample([(2, 4, 1, 2), (2, 3, 1, 2), (2, 3, 1, 2)], {"layout": "BSND"}),
]

RECORDS = [
    # ---------------------------------------------------------------- pointwise
    OpRecord("exp", [OpSample([(4, 3)]), OpSample([(5, 1, 2)])], placements="all"),
    OpRecord("silu", [OpSample([(4, 3)]), OpSample([(5, 1, 2)])], placements="all"),
    OpRecord("gelu", [OpSample([(4, 3)]), OpSample([(5, 1, 2)])], placements="all"),
    OpRecord("cast", [
        OpSample([(4, 3)], {"dtype": "float16"}),
        OpSample([(5, 1, 2)], {"dtype": "float64"}),
        OpSample([(4, 3)], {"dtype": "int32"}),
        OpSample([(5, 2)], {"dtype": "float32"}, dtypes=["int64"]),
        OpSample([(3, 4)], {"dtype": "int64"}, dtypes=["int32"]),
    ], placements="all"),
    OpRecord("scale", [OpSample([(4, 3)], {"factor": -1.5}), OpSample([(5, 1, 2)], {"factor": 3})],
             placements="all"),
    OpRecord("div", [OpSample([(4, 3), (3,)]), OpSample([(3, 1), (3, 4)]), OpSample([(5, 2), (5, 2)])],
             placements=80),
    OpRecord("silu_mul", [OpSample([(4, 3), (4, 3)]), OpSample([(3,), (5, 3)]), OpSample([(2, 1, 3), (2, 4, 3)])],
             placements=80),
    OpRecord("silu_grad", [OpSample([(4, 3), (4, 3)]), OpSample([(5, 2), (2,)])], placements=60),
    OpRecord("gelu_grad", [OpSample([(4, 3), (4, 3)]), OpSample([(5, 2), (2,)])], placements=60),
    # ---------------------------------------------------------------- swiglu
    OpRecord("swiglu", [
        OpSample([(3, 8)]),
        OpSample([(4, 2, 5)], {"dim": 0}),
        OpSample([(5, 1, 6)], {"dim": -1}),
        OpSample([(3, 5)]),  # odd split dim: invalid-shape everywhere
    ], placements="all"),
    OpRecord("swiglu_grad", [OpSample([(3, 4), (3, 8)]), OpSample([(5, 1, 3), (5, 1, 6)])], placements=80),
    # ---------------------------------------------------------------- norms
    OpRecord("rms_norm", [
        OpSample([(4, 3, 6), (6,)]),
        OpSample([(5, 2, 3), (2, 3)], {"normalized_ndim": 2, "eps": 1e-5}),
        OpSample([(3, 1, 5), (5,)], partial_ok=False),
    ], placements=100),
    # x Replicate beside a weight sharded on the normalised dim or Partial (DTensor's S(-1) / P(sum)
    # outputs); uneven: 10 on 4 ranks is 3, 3, 3, 1
    OpRecord("rms_norm", [OpSample([(3, 10), (10,)]), OpSample([(2, 5, 3), (5, 3)], {"normalized_ndim": 2})],
             meshes=((4,), (2, 2)), placements="all", id="rms_norm-param-axes"),
    OpRecord("rms_norm_grad", [OpSample([(4, 3, 6), (4, 3, 6), (6,)]), OpSample([(5, 4), (5, 4), (4,)])],
             placements=60),
    OpRecord("layer_norm", [
        OpSample([(4, 3, 6), (6,), (6,)]),
        OpSample([(3, 5, 4), (5, 4), (5, 4)], {"normalized_ndim": 2}),
        OpSample([(5, 1, 3), (3,), (3,)], partial_ok=False),
    ], placements=80),
    OpRecord("layer_norm", [OpSample([(3, 10), (10,), (10,)]), OpSample([(2, 5, 3), (5, 3), (5, 3)],
                                                                     {"normalized_ndim": 2})],
             meshes=((4,), (2, 2)), placements=150, id="layer_norm-param-axes"),
    OpRecord("layer_norm_grad", [OpSample([(4, 3, 6), (4, 3, 6), (6,), (6,)]), OpSample([(5, 4), (5, 4), (4,), (4,)])],
             placements=60),
    # ---------------------------------------------------------------- softmax
    OpRecord("softmax", [OpSample([(4, 5)], {"axis": 0}), OpSample([(3, 1, 4)]), OpSample([(5, 3, 2)], {"axis": 1})],
             placements="all"),
    OpRecord("log_softmax", [OpSample([(4, 5)]), OpSample([(3, 1, 4)], {"axis": 0}), OpSample([(5, 3, 2)],
                                                                                               {"axis": -2})],
             placements="all"),
    OpRecord("softmax_grad", [OpSample([(4, 5), (4, 5)]), OpSample([(5, 3), (5, 3)], {"axis": 0})], placements=60),
    OpRecord("log_softmax_grad", [OpSample([(4, 5), (4, 5)]), OpSample([(5, 3), (5, 3)], {"axis": 0})],
             placements=60),
    # a size-0 softmax axis is an empty softmax (numpy's max of nothing raised in the kernel)
    OpRecord("softmax", [OpSample([(0, 4)], {"axis": 0}), OpSample([(3, 0)])], placements=20, id="softmax-size-0"),
    OpRecord("log_softmax", [OpSample([(0, 4)], {"axis": 0}), OpSample([(3, 0)])], placements=20,
             id="log_softmax-size-0"),
    # ---------------------------------------------------------------- attention
    OpRecord("scaled_dot_product_attention", _ATTENTION, placements=80, id="attention"),
    # no keys: zeros; head dim 0: fine with a scale, invalid-shape without (1/sqrt(0))
    OpRecord("scaled_dot_product_attention", [
        OpSample([(1, 2, 4, 4), (1, 2, 0, 4), (1, 2, 0, 4)], {"causal": True}),
        OpSample([(1, 2, 3, 0), (1, 2, 3, 0), (1, 2, 3, 2)], {"scale": 0.5}),
        OpSample([(1, 2, 3, 0), (1, 2, 3, 0), (1, 2, 3, 2)]),
    ], placements=20, id="attention-size-0"),
    OpRecord("scaled_dot_product_attention_grad", [
        OpSample([(2, 2, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4), (2, 2, 4, 4)], {"causal": True}),
        OpSample([(3, 5, 2, 3), (3, 5, 2, 4), (3, 3, 2, 4), (3, 3, 2, 3)], {"layout": "BSND"}),
    ], placements=80, id="attention_grad"),
]
