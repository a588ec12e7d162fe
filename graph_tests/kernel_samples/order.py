"""Kernel samples of the order op family (see the package docstring): ties in int and float inputs,
size-1 and uneven dims, both directions, every attr."""

import numpy as np


def samples(rng, f32) -> dict:
    x = f32(3, 5, 4)
    ties = rng.integers(0, 3, (4, 7)).astype(np.int32)  # many ties
    float_ties = rng.integers(-2, 2, (3, 6)).astype(np.float32)
    flags = rng.integers(0, 2, (3, 5)).astype(bool)
    big = rng.integers(0, 4, (2, 300)).astype(np.int64)  # a longer row of ties
    dv, idx = f32(3, 5, 2), np.array(rng.integers(0, 4, (3, 5, 2)), dtype=np.int64)
    y = f32(5, 1)
    cand = {}
    for args, attrs in [((x,), {"k": 2, "chunks": 2, "dim": 1}), ((ties,), {"k": 3, "chunks": 3}),
                        ((ties,), {"k": 2, "chunks": 4, "largest": False, "start": 5}),
                        ((float_ties,), {"k": 2, "chunks": 4, "dim": 0})]:
        cand.setdefault("topk_candidates", []).append((args, attrs))
    from layout_prop.kernels.order_numpy import KERNELS as numpy_kernels  # candidates with padding and ties

    merges, merge_grads = [], []
    for args, attrs in cand["topk_candidates"]:
        values, indices = numpy_kernels["topk_candidates"](*args, **attrs)
        merge = {"k": attrs["k"], "dim": attrs.get("dim", -1), "largest": attrs.get("largest", True)}
        merges.append(((values, indices), merge))
        cot = f32(*numpy_kernels["topk_merge"](values, indices, **merge)[0].shape)
        merge_grads.append(((cot, values.astype(np.float32), indices), merge))
    offsets = f32(3, 4, 4)
    return {
        **cand,
        "chunk_sum": [((x,), {"dim": 1, "chunks": 4}), ((ties,), {"dim": 1, "chunks": 3}),
                      ((flags,), {"dim": 0, "chunks": 2}), ((x,), {"dim": 0, "chunks": 4})],
        "chunk_sum_grad": [((f32(3, 4, 4),), {"dim": 1, "size": 5, "chunks": 4}),
                           ((f32(2, 3),), {"dim": 1, "size": 7, "chunks": 3})],
        "chunk_cumsum": [((x, offsets), {"dim": 1, "chunks": 4}), ((x,), {"dim": 1, "chunks": 2, "reverse": True}),
                         ((x, offsets), {"dim": 1, "chunks": 4, "exclusive": True, "reverse": True}),
                         ((ties,), {"dim": 1, "chunks": 3})],
        "topk_merge": merges,
        "topk_merge_grad": merge_grads,
        "topk_candidates_grad": [((dv, idx - 1), {"dim": 2, "size": 4, "chunks": 2}),
                                 ((dv, idx), {"dim": 1, "size": 3, "chunks": 1, "start": 2})],
        "topk": [((x,), {"k": 2}), ((x,), {"k": 3, "dim": 1, "largest": False}), ((ties,), {"k": 4}),
                 ((ties,), {"k": 2, "dim": 0, "largest": False}), ((float_ties,), {"k": 6}), ((flags,), {"k": 3}),
                 ((big,), {"k": 17}), ((x,), {"k": 0})],
        "sort": [((x,), {}), ((x,), {"dim": 0, "descending": True}), ((ties,), {"descending": True}),
                 ((ties,), {"dim": 0}), ((float_ties,), {"descending": True, "stable": True}), ((flags,), {}),
                 ((big,), {"descending": True})],
        "argmax": [((x,), {"dim": 1}), ((ties,), {"dim": 1, "keepdim": True}), ((ties,), {}),
                   ((float_ties,), {"dim": 0}), ((flags,), {"dim": 1})],
        "argmin": [((x,), {"dim": -1}), ((ties,), {"dim": 0}), ((ties,), {"keepdim": True}), ((flags,), {"dim": 1})],
        "cumsum": [((x,), {"dim": 1}), ((x,), {"dim": 0, "exclusive": True}), ((x,), {"dim": 2, "reverse": True}),
                   ((x,), {"dim": 1, "exclusive": True, "reverse": True}), ((ties,), {"dim": 1}),
                   ((flags,), {"dim": 0})],
        "prod": [((x,), {"dims": [1]}), ((x,), {"dims": [0, 2], "keepdim": True}), ((ties,), {"dims": None}),
                 ((flags,), {"dims": 1}), ((float_ties,), {"dims": [1]})],
        "maximum": [((x, y[None, :, :]), {}), ((ties, ties.T[:4, :1]), {}), ((float_ties, float_ties[::-1]), {})],
        "minimum": [((x, y[None, :, :]), {}), ((ties, ties[:1]), {}), ((float_ties, float_ties[::-1]), {})],
        "topk_grad": [((dv, idx), {"dim": 2, "size": 4}), ((dv, idx), {"dim": 1, "size": 6, "start": 1}),
                      ((f32(4, 3), np.array(rng.integers(0, 5, (4, 3)), dtype=np.int64)), {"dim": 0, "size": 5})],
        "maximum_grad": [((f32(3, 5, 4), x, f32(5, 1)), {}), ((f32(3, 6), float_ties, float_ties[::-1]), {}),
                         ((f32(3, 6), float_ties, float_ties[::-1]), {"minimum": True})],
        "prod_grad": [((f32(3, 4), x), {"dims": [1]}), ((f32(1, 5, 1), x), {"dims": [0, 2], "keepdim": True}),
                      ((f32(3), float_ties), {"dims": [1]})],
    }
