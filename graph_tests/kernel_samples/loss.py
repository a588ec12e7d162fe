"""Kernel samples of the loss op family (see the package docstring).

Targets include ignored tokens (-100, or ignore_index 3); the parts given to
``cross_entropy_combine`` are a real cross entropy's (a positive sum of exponentials).
``token_slices`` and ``vocab_start`` are the localised attrs a rank's kernel gets.
"""

import numpy as np

from layout_prop.kernels.loss_numpy import cross_entropy_parts


def samples(rng, f32) -> dict:
    logits = f32(2, 3, 9)
    target = rng.integers(0, 9, (2, 3)).astype(np.int64)
    target[0, 1] = -100
    target3 = np.where(target == -100, 3, target)  # for ignore_index 3
    m = logits.max(axis=-1)
    parts = cross_entropy_parts(logits, target, m)
    piece = logits[..., 4:8]
    dy = f32(2, 3)
    dparts = f32(2, 3, 3)
    return {
        "cross_entropy": [((logits, target), {}),
                          ((logits, target), {"reduction": "sum", "label_smoothing": 0.2}),
                          ((logits, target3), {"reduction": "none", "ignore_index": 3}),
                          ((logits[:1], target), {"token_slices": [[1, 2], [0, 3]]})],
        "cross_entropy_grad": [((f32(), logits, target), {}),
                               ((dy, logits, target), {"reduction": "none", "label_smoothing": 0.1}),
                               ((f32(), logits[1:], target), {"token_slices": [[1, 2], [0, 3]]})],
        "cross_entropy_parts": [((logits, target, m), {}),
                                ((piece, target, m), {"vocab_start": 4}),
                                ((logits[..., :0], target, m), {"vocab_start": 9})],
        "cross_entropy_parts_grad": [((dparts, logits, target, m), {}),
                                     ((dparts, piece, target3, m), {"vocab_start": 4, "ignore_index": 3})],
        "cross_entropy_combine": [((parts, m, target), {"num_classes": 9}),
                                  ((parts, m, target), {"num_classes": 9, "reduction": "none",
                                                        "label_smoothing": 0.3})],
        "cross_entropy_combine_grad": [((f32(), parts, target), {"num_classes": 9}),
                                       ((dy, parts, target), {"num_classes": 9, "reduction": "none",
                                                              "label_smoothing": 0.3})],
        "dropout": [((logits,), {"p": 0.3, "seed": 5}),
                    ((piece,), {"p": 0.5, "offsets": [0, 1, 4], "global_shape": [2, 4, 9]}),
                    ((logits,), {"p": 0.5, "training": False})],
        "multinomial": [((np.exp(logits),), {"num_samples": 4}),
                        ((np.exp(piece),), {"num_samples": 5, "replacement": True, "offsets": [1, 0],
                                            "global_shape": [3, 3]})],
    }
