"""Kernel samples of the copying op family (see the package docstring).

Localised attrs as a rank gets them: an explicit local ``shape`` for ``expand`` and
``full_like``, a piece's ``shape`` for ``repeat_interleave_grad``.
"""

import numpy as np


def samples(rng, f32) -> dict:
    x, col = f32(5, 3), f32(5, 1)
    ints = rng.integers(-3, 4, (4, 3)).astype(np.int64)
    three = f32(3, 2, 4)
    return {
        "expand": [((col,), {"shape": [2, -1, 4]}), ((ints[:1],), {"shape": [3, 3]}), ((col[:0],), {"shape": [0, 2]})],
        "stack": [((x, x * 2), {"dim": 1}), ((ints, ints), {"dim": -1}), ((col,), {})],
        "unbind2": [((x[:2],), {"dim": 0}), ((three[:, :, :2],), {"dim": 2})],
        "unbind3": [((three,), {"dim": 0})],
        "unbind4": [((three,), {"dim": 2})],
        "unbind5": [((x,), {})],
        "unbind6": [((f32(2, 6),), {"dim": 1})],
        "unbind7": [((f32(7),), {})],
        "unbind8": [((f32(8, 1),), {})],
        "unbind": [((three,), {"dim": 1}), ((x,), {"dim": -1}), ((f32(1, 4),), {})],  # 2, 3 and 1 outputs
        "full_like": [((x,), {"fill_value": 2.5}), ((x,), {"fill_value": 3, "dtype": "int64", "shape": [2, 2]}),
                      ((ints,), {"fill_value": -1, "dtype": None, "shape": None})],
        "zeros_like": [((x,), {"fill_value": 0})],
        "ones_like": [((ints,), {"fill_value": 1, "dtype": "float32"})],
        "new_ones": [((x,), {"fill_value": 1, "shape": [4, 1]})],
        "pad": [((x,), {"pad": [1, 2]}), ((three,), {"pad": [0, 0, -1, 1, 2, 0], "value": 1.5}),
                ((ints,), {"pad": [-3, 1], "value": 7}), ((x,), {"pad": [-2, -1]})],
        "repeat_interleave": [((x,), {"repeats": 2, "dim": 0}), ((x,), {"repeats": [1, 0, 3], "dim": 1}),
                              ((ints,), {"repeats": 2})],
        "repeat_interleave_grad": [((f32(10, 3),), {"repeats": 2, "dim": 0, "shape": [5, 3]}),
                                   ((f32(5, 4),), {"repeats": [1, 0, 3], "dim": 1, "shape": [5, 3]}),
                                   ((f32(24),), {"repeats": 2, "dim": None, "shape": [4, 3]})],
    }
