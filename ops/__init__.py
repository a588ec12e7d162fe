"""Built-in ops; importing this package registers their rules.

One module per op family: :mod:`.rpe` (RotaryPositionEmbedding), :mod:`.elementwise`,
:mod:`.linalg` (einsum, matmul, linear, embedding, reductions), :mod:`.shape` (reshape,
transpose, split, concat...), :mod:`.nn` (norms, softmax, attention, activations),
:mod:`.redistribute`.
"""

from . import elementwise, linalg, nn, redistribute, rpe, shape  # noqa: F401
