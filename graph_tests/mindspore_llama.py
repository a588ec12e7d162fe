"""A Llama decoder written as a MindSpore ``nn.Cell`` (MindFormers style), for the import tests.

RMSNorm (``ops.rms_norm``), q/k/v/o ``nn.Dense`` without bias, the head split by reshape
and transpose, ``ops.rotary_position_embedding`` on q and k, causal attention
(``ops.matmul``, the scale, a constant causal mask, ``ops.softmax``), and the SwiGLU MLP
(``w1``, ``w3``, ``w2``), with Meta's parameter names (``layers.0.attention.wq.weight``).
"""

import contextlib

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops


class RMSNorm(nn.Cell):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.eps = eps
    def construct(self, x):
        return ops.rms_norm(x, self.weight, self.eps)[0]

class Attention(nn.Cell):
    def __init__(self, batch, seq, hidden, heads):
        super().__init__()
        self.b, self.s, self.n, self.d = batch, seq, heads, hidden // heads
        self.wq = nn.Dense(hidden, hidden, has_bias=False)
        self.wk = nn.Dense(hidden, hidden, has_bias=False)
        self.wv = nn.Dense(hidden, hidden, has_bias=False)
        self.wo = nn.Dense(hidden, hidden, has_bias=False)
        self.scale = 1.0 / float(np.sqrt(self.d))
        self.mask = Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))
    def heads(self, t):
        return t.reshape(self.b, self.s, self.n, self.d).transpose(0, 2, 1, 3)
    def construct(self, x, cos, sin):
        q, k, v = self.heads(self.wq(x)), self.heads(self.wk(x)), self.heads(self.wv(x))
        q = ops.rotary_position_embedding(q, cos, sin, 0)
        k = ops.rotary_position_embedding(k, cos, sin, 0)
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale + self.mask
        out = ops.matmul(ops.softmax(scores, -1), v)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(self.b, self.s, self.n * self.d))

class FlashAttention(Attention):
    """The same attention through ``ops.flash_attention_score`` (BNSD, causal by sparse mode 2 and the compressed
    2048 x 2048 mask), as MindFormers writes it for Ascend."""
    def __init__(self, batch, seq, hidden, heads):
        super().__init__(batch, seq, hidden, heads)
        self.mask = Tensor(np.triu(np.ones((2048, 2048), np.uint8), 1))
    def construct(self, x, cos, sin):
        q, k, v = self.heads(self.wq(x)), self.heads(self.wk(x)), self.heads(self.wv(x))
        q = ops.rotary_position_embedding(q, cos, sin, 0)
        k = ops.rotary_position_embedding(k, cos, sin, 0)
        out = ops.flash_attention_score(q, k, v, self.n, attn_mask=self.mask, scalar_value=self.scale,
                                        input_layout="BNSD", sparse_mode=2)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(self.b, self.s, self.n * self.d))

class FeedForward(nn.Cell):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Dense(hidden, ffn, has_bias=False)
        self.w2 = nn.Dense(ffn, hidden, has_bias=False)
        self.w3 = nn.Dense(hidden, ffn, has_bias=False)
    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))

class Block(nn.Cell):
    def __init__(self, batch=2, seq=8, hidden=32, heads=4, ffn=64, flash=False):
        super().__init__()
        self.attention_norm = RMSNorm(hidden)
        self.attention = (FlashAttention if flash else Attention)(batch, seq, hidden, heads)
        self.ffn_norm = RMSNorm(hidden)
        self.feed_forward = FeedForward(hidden, ffn)
    def construct(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

class Model(nn.Cell):
    def __init__(self, layers=1, **sizes):
        super().__init__()
        self.layers = nn.CellList([Block(**sizes) for _ in range(layers)])
    def construct(self, x, cos, sin):
        cos, sin = ops.expand_dims(cos, 1), ops.expand_dims(sin, 1)  # (1, S, D) -> (1, 1, S, D), shared
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def example_inputs(batch=2, seq=8, hidden=32, heads=4, seed=0):
    """``x (B, S, H)``, ``cos`` and ``sin (1, S, D)`` as MindSpore tensors (as the ONNX sample takes them)."""
    rng = np.random.default_rng(seed)
    d = hidden // heads
    return (Tensor(rng.standard_normal((batch, seq, hidden)).astype(np.float32)),
            Tensor(rng.standard_normal((1, seq, d)).astype(np.float32)),
            Tensor(rng.standard_normal((1, seq, d)).astype(np.float32)))


@contextlib.contextmanager
def graph_mode():
    """MindSpore's GRAPH_MODE on CPU inside the block, the mode before it restored after.

    A mode left set leaks into every later test of the session: GRAPH_MODE compiles
    ``mindspore.grad`` of the RPE kernels, whose shape checks raise ``OpError``, which
    MindSpore's graph parser refuses.
    """
    before = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    try:
        yield
    finally:
        ms.set_context(mode=before)
