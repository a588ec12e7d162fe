"""Kernel samples of the shape op family's torch-named split and chunk (see the package docstring; the
other shape kernels are sampled in ``test_msrun.kernel_samples``).

A rank's chunk of a strided axis gets its localised ``sizes``; one piece is one output.
"""

import numpy as np


def samples(rng, f32) -> dict:
    x = f32(7, 3)
    ints = rng.integers(-3, 4, (4, 6)).astype(np.int64)
    return {
        "split": [((x,), {"split_size_or_sections": 3, "axis": 0}), ((ints,), {"split_size_or_sections": [1, 0, 5],
                                                                              "axis": 1}),
                  ((x,), {"split_size_or_sections": 7})],
        "chunk": [((x,), {"chunks": 3}), ((x,), {"chunks": 2, "axis": 1}), ((ints,), {"chunks": 1}),
                  ((x,), {"chunks": 2, "axis": 0, "sizes": [0, 7]})],
    }
