"""Records of ``sharding_constraint`` (issue 29, pinned activations): the node a spec's
``constraints:`` section inserts after each pinned value.  Every input placement meets each
pinned layout: equal (nothing to do), a free local slice, or ``constraint-unmet`` fixed by the
redistribution ``--reshard`` inserts; forward and backward compared with one device.
"""

from . import OpRecord, OpSample


def _pinned(shape, placements) -> OpSample:
    return OpSample([shape], {"placements": list(placements)}, strided=True)


def _mapped(shape, tensor_map) -> OpSample:
    return OpSample([shape], {"tensor_map": list(tensor_map)}, strided=True)


RECORDS = [
    OpRecord("sharding_constraint", [_pinned((4, 6), ["S(0)"]), _pinned((4, 6), ["R"]), _pinned((6, 4), ["S(1)"]),
                                     _pinned((8, 2), ["_S(0,2)"]), _pinned((4, 6), ["P(sum)"])],
             meshes=((4,),), placements="all", id="constraint-1d"),
    # tensor_map pins fit any mesh (0 is its last axis), as the gradient test's 1-axis meshes need
    OpRecord("sharding_constraint", [_mapped((4, 6), [0, -1]), _mapped((5, 3), [-1, 0]), _mapped((4, 6), [-1, -1])],
             meshes=((2, 2),), placements="all", id="constraint-2d"),
]
