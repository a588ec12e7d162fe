"""Built-in ops; importing this package registers their rules.

One module per op family: :mod:`.rpe` (RotaryPositionEmbedding), :mod:`.elementwise`,
:mod:`.linalg` (einsum, matmul, linear, embedding, reductions), :mod:`.shape` (reshape,
transpose, split, concat...), :mod:`.nn` (norms, softmax, attention, activations),
:mod:`.redistribute`, :mod:`.index` (gather, scatter, where...), :mod:`.order` (topk, sort,
cumsum...), :mod:`.copying` (pad, expand, stack...), :mod:`.loss` (cross entropy and the random ops),
:mod:`.attention` (fused attention) and :mod:`.moe` (expert routing).
"""

from . import elementwise, linalg, nn, redistribute, rpe, shape  # noqa: F401
from . import attention, copying, index, loss, moe, order  # noqa: F401
from . import ring  # noqa: F401  (after nn: ring attention's ops)
