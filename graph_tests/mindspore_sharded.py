"""A MindSpore cell with a shard() strategy on its MatMul, for the import tests."""

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
