"""Kernel samples of the index op family (see the package docstring).

Indices cover uneven pieces (a rank's ``start`` past 0, entries outside its piece),
duplicates (scatter's last write wins, scatter_add and index_add add up), int32 and
int64 indices, broadcast masks and size-1 dims.
"""

import numpy as np


def samples(rng, f32) -> dict:
    x = f32(4, 9)
    index = rng.integers(0, 9, (3, 9)).astype(np.int64)  # 3 <= 4 rows: x's corner
    dup = np.array([[1, 1, 2], [0, 3, 3]], np.int32)  # duplicate targets along dim 1
    ids = rng.integers(0, 9, (5,)).astype(np.int64)
    mask = rng.integers(0, 2, (4, 1)).astype(bool)
    cond = rng.integers(0, 2, (4, 9)).astype(bool)
    nd = np.array([[1, 4], [3, 0], [1, 4], [2, 5], [0, 8], [1, 3]])  # index tuples into (4, 9), one duplicate
    return {
        "gather": [((x, index), {"dim": 1}), ((x[:, 3:6], index), {"dim": 1, "start": 3, "dim_size": 9}),
                   ((x, dup), {"dim": -1})],
        "scatter_src_grad": [((x, index), {"dim": 1}), ((x[:, 3:6], index), {"dim": 1, "start": 3, "dim_size": 9}),
                             ((x, dup), {"dim": 1})],
        "index_select": [((x, ids), {"dim": 1}), ((x[:, 6:], ids.astype(np.int32)), {"dim": 1, "start": 6,
                                                                                    "dim_size": 9}),
                         ((x, ids[:2] % 4), {"dim": 0})],
        "scatter": [((x, index, f32(3, 9)), {"dim": 1}), ((x[:, 3:6], index, f32(3, 9)),
                                                          {"dim": 1, "start": 3, "dim_size": 9}),
                    ((x, dup, f32(2, 3)), {"dim": 1})],
        "scatter_add": [((x, index, f32(3, 9)), {"dim": 1}), ((x[:, 3:6], index, f32(3, 9)),
                                                              {"dim": 1, "start": 3, "dim_size": 9}),
                        ((x, dup, f32(2, 3)), {"dim": 1})],
        "index_add": [((x, ids, f32(4, 5)), {"dim": 1}), ((x[:, 6:], ids, f32(4, 5)),
                                                         {"dim": 1, "start": 6, "dim_size": 9}),
                      ((x, ids[:3] % 4, f32(3, 9)), {"dim": 0})],
        "index_copy": [((x, ids, f32(4, 5)), {"dim": 1}), ((x[:, 6:], ids, f32(4, 5)),
                                                          {"dim": 1, "start": 6, "dim_size": 9}),
                       ((x, np.array([3, 1, 3]), f32(3, 9)), {"dim": 0})],
        "index_copy_src_grad": [((x, ids), {"dim": 1}), ((x[:, 6:], ids), {"dim": 1, "start": 6, "dim_size": 9}),
                                ((x, np.array([3, 1, 3], np.int32)), {"dim": 0})],
        "gather_nd": [((x, nd), {}), ((x[1:3, 3:6], nd), {"starts": [1, 3], "dim_sizes": [4, 9]}),
                      ((x, nd[:, :1]), {})],
        "scatter_nd": [((x, nd, f32(6)), {}), ((x, nd, f32(6)), {"reduction": "add"}),
                       ((x[1:3, 3:6], nd, f32(6)), {"starts": [1, 3], "dim_sizes": [4, 9]}),
                       ((x, nd[:, :1], f32(6, 9)), {"reduction": "add"})],
        "index_put": [((x, nd[:, :1], f32(6, 9)), {}), ((x, nd, f32(6)), {"accumulate": True})],
        "scatter_nd_src_grad": [((x, nd), {}), ((x[1:3, 3:6], nd), {"starts": [1, 3], "dim_sizes": [4, 9]})],
        "masked_fill": [((x, mask), {"value": -1.5}), ((index, cond[:3]), {"value": 7})],
        "masked_scatter": [((x, cond, f32(40)), {}), ((x, mask, f32(4, 9)), {}),
                           ((x[1:3, 3:6], cond, f32(40)), {"box": [[1, 3], [3, 6]], "full_shape": [4, 9]})],
        "masked_scatter_src_grad": [((x, cond), {"shape": [40]}), ((x[1:3, 3:6], mask),
                                                                   {"shape": [6, 6], "box": [[1, 3], [3, 6]],
                                                                    "full_shape": [4, 9]})],
        "where": [((cond, x, f32(9)), {}), ((mask, f32(1, 9), x), {})],
        "one_hot": [((index, ), {"num_classes": 9}), ((ids.astype(np.int32), ), {"num_classes": 12})],
        "isin": [((index, ids), {}), ((dup, ids), {}), ((x, x[:2, :3]), {})],
    }
