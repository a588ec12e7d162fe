"""Small MindSpore cells for the import tests: a shard() strategy, and a mix of primitives."""

import numpy as np
from mindspore import Parameter, Tensor, nn, ops


class ShardedMatMul(nn.Cell):
    """``x @ w`` with ``shard(((2, 1), (1, 2)))``: x split on rows, w on columns."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.ones((8, 4), np.float32)), name="w")
        self.mm = ops.MatMul().shard(((2, 1), (1, 2)))

    def construct(self, x):
        return self.mm(x, self.w)


class Mixed(nn.Cell):
    """nn.Embedding, nn.Dense with a bias on a 3-D input, nn.LayerNorm, ops.split, the erf GELU,
    a sigmoid gate, a strided slice, sum and mean, log_softmax."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.fc = nn.Dense(32, 48, has_bias=True)
        self.norm = nn.LayerNorm((48,))

    def construct(self, ids):
        y = self.norm(self.fc(self.tok(ids)))
        a, b = ops.split(y, 24, axis=-1)
        z = (ops.gelu(a) * ops.sigmoid(b))[:, :4]
        return ops.log_softmax(ops.sum(z, -1, keepdim=True) + ops.mean(z, -1, keep_dims=True), -1)


class FlashAttention(nn.Cell):
    """ops.flash_attention_score, BNSD, causal through sparse_mode 2 and the compressed 2048x2048 mask."""

    def __init__(self):
        super().__init__()
        self.mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))

    def construct(self, q, k, v):
        return ops.flash_attention_score(q, k, v, 4, attn_mask=self.mask, scalar_value=0.35, input_layout="BNSD",
                                         sparse_mode=2)


class FlashAttentionOf(nn.Cell):
    """ops.flash_attention_score with ``head_num`` and the keywords given (``attn_mask`` a constant)."""

    def __init__(self, head_num, attn_mask=None, **keywords):
        super().__init__()
        self.head_num, self.mask, self.keywords = head_num, attn_mask, keywords

    def construct(self, q, k, v):
        return ops.flash_attention_score(q, k, v, self.head_num, attn_mask=self.mask, **self.keywords)


class FlashAttentionWithShift(nn.Cell):
    """ops.flash_attention_score with a real_shift (a positional bias on the scores), BNSD."""

    def construct(self, q, k, v, shift):
        return ops.flash_attention_score(q, k, v, 2, real_shift=shift, input_layout="BNSD")


class TwoOutputs(nn.Cell):
    """A cell that returns a tuple."""

    def construct(self, x):
        return ops.exp(x), ops.neg(x)


class DecomposedRMSNorm(nn.Cell):
    """MindFormers' LlamaRMSNorm written out: square, mean, add eps, rsqrt, mul, mul by the weight."""

    def __init__(self):
        super().__init__()
        self.weight = Parameter(Tensor(np.linspace(0.5, 1.5, 16).astype(np.float32)), name="weight")
        self.square, self.mean, self.rsqrt = ops.Square(), ops.ReduceMean(keep_dims=True), ops.Rsqrt()

    def construct(self, x):
        factor = self.rsqrt(self.mean(self.square(x), -1) + 1e-5)
        return (x * factor) * self.weight


class RepeatKV(nn.Cell):
    """Grouped-query key/value heads repeated as MindFormers does (reshape, Tile, reshape), and by
    broadcast_to: (B, 1, S, D) -> (B, 2, S, D) each, added."""

    def __init__(self):
        super().__init__()
        self.tile = ops.Tile()

    def construct(self, k):
        b, n, s, d = k.shape
        tiled = self.tile(k.reshape(b, n, 1, s * d), (1, 1, 2, 1)).reshape(b, n * 2, s, d)
        broadcast = ops.broadcast_to(k.reshape(b, n, 1, s, d), (b, n, 2, s, d)).reshape(b, n * 2, s, d)
        return tiled + broadcast
