"""Records of the moe family: token dispatch to experts, combine, and the routing weights' gradient.

The kit's random indices lie in [0, 8): with 8 experts every choice names an expert (and
a token may name one twice, which the slot arithmetic must count), with 4 experts some
name none and are dropped.  Eight tokens in 4 groups let every token shard of the (4,)
and (2, 2) meshes hold whole groups; ``groups: 1`` on sharded tokens is
``uneven-token-groups``.  A capacity factor of 1.0 with 4 experts drops choices, in global
token order; with ``capacity_scope: group`` each group of 2 tokens keeps 1 choice per expert.
``dense: true`` is one buffer of the global capacity (4 slots an expert at 1.0, 6 dropless).
"""

from . import OpRecord, OpSample

_ROUTED = dict(dtypes=["float32", "int64", "float32"], requires_grad=[True, False, True])
_INDICES = dict(dtypes=["float32", "int64"], requires_grad=[True, False])
_MESHES = ((4,), (2, 2))

RECORDS = [
    OpRecord("moe_dispatch", [
        OpSample([(8, 3), (8, 2), (8, 2)], {"num_experts": 8, "groups": 4}, **_ROUTED),
        OpSample([(8, 3), (8, 2), (8, 2)], {"num_experts": 4, "capacity_factor": 1.0, "groups": 4}, **_ROUTED),
        OpSample([(6, 4), (6, 1)], {"num_experts": 8, "groups": 2}, **_INDICES),
        OpSample([(8, 2), (8, 2), (8, 2)], {"num_experts": 8}, **_ROUTED),
        OpSample([(8, 3), (8, 2), (8, 2)], {"num_experts": 4, "capacity_factor": 1.0, "groups": 4,
                                            "capacity_scope": "group"}, **_ROUTED),
    ], meshes=_MESHES, placements=40, id="moe-dispatch"),
    OpRecord("moe_combine", [
        OpSample([(8, 8, 3), (8, 2), (8, 2)], {"groups": 4}, **_ROUTED),
        OpSample([(4, 8, 3), (8, 2), (8, 2)], {"num_experts": 4, "capacity_factor": 1.0, "groups": 4}, **_ROUTED),
        OpSample([(8, 6, 4), (6, 1)], {"groups": 2}, **_INDICES),
        OpSample([(4, 4, 3), (8, 2), (8, 2)], {"capacity_factor": 1.0, "groups": 4, "capacity_scope": "group"},
                 **_ROUTED),
    ], meshes=_MESHES, placements=40, id="moe-combine"),
    OpRecord("moe_weight_grad", [
        OpSample([(8, 8, 3), (8, 3), (8, 2)], {"groups": 4}, dtypes=["float32", "float32", "int64"]),
        OpSample([(4, 8, 3), (8, 3), (8, 2)], {"capacity_factor": 1.0, "groups": 4},
                 dtypes=["float32", "float32", "int64"]),
    ], meshes=_MESHES, placements=60, backward=False, id="moe-weight-grad"),
    # the dense buffer of the global capacity: sharded tokens dispatch into a P(sum) buffer, a
    # buffer sharded on E or on the slots combines into a P(sum) output
    OpRecord("moe_dispatch", [
        OpSample([(8, 3), (8, 2), (8, 2)], {"num_experts": 4, "capacity_factor": 1.0, "dense": True}, **_ROUTED),
        OpSample([(6, 4), (6, 1)], {"num_experts": 8, "dense": True}, **_INDICES),
    ], meshes=_MESHES, placements=40, id="moe-dispatch-dense"),
    OpRecord("moe_combine", [
        OpSample([(4, 4, 3), (8, 2), (8, 2)], {"capacity_factor": 1.0, "dense": True}, **_ROUTED),
        OpSample([(8, 6, 4), (6, 1)], {"dense": True}, **_INDICES),
    ], meshes=_MESHES, placements=30, id="moe-combine-dense"),
    OpRecord("moe_weight_grad", [
        OpSample([(4, 4, 3), (8, 3), (8, 2)], {"capacity_factor": 1.0, "dense": True},
                 dtypes=["float32", "float32", "int64"]),
    ], meshes=_MESHES, placements=40, backward=False, id="moe-weight-grad-dense"),
]
