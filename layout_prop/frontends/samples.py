"""Sample models for the tests and the benchmarks: a Llama decoder laid out as
``torch.onnx.export`` writes it (the TorchScript exporter on a Meta-style Llama, opset 17).

Per layer: RMSNorm decomposed (``Pow``, ``ReduceMean``, ``Add`` eps, ``Sqrt``,
``Reciprocal``, two ``Mul``), q/k/v projections as ``MatMul`` with ``(in, out)``
initializers, the head split through a shape subgraph (``Shape``, ``Gather``,
``Unsqueeze``, ``Concat``, ``Reshape``) and ``Transpose``, rotate-half RoPE (``Slice``,
``Neg``, ``Concat``, ``Mul``, ``Add``) with ``cos``/``sin`` given as ``(1, S, D)`` inputs
and unsqueezed to ``(1, 1, S, D)``, attention as ``MatMul`` / ``Mul`` by the scale /
``Add`` of a constant causal mask / ``Softmax`` / ``MatMul``, the output projection and
residual, then SwiGLU (``Sigmoid`` and ``Mul`` for SiLU, ``Mul`` by up, ``MatMul`` down)
and the second residual.  Parameter names are Meta's: ``layers.0.attention.wq.weight``,
``layers.0.attention_norm.weight``, ``layers.0.feed_forward.w1.weight``...
"""

from __future__ import annotations

import numpy as np

__all__ = ["llama_onnx", "LLAMA_PLAN"]

LLAMA_PLAN = {
    "mesh": {"shape": [2, 2, 2], "names": ["dp", "sp", "tp"]},
    "inputs": {"x": ["S(0)", "S(1)", "S(1)"], "cos": ["R", "S(1)", "R"], "sin": ["R", "S(1)", "R"]},
    "parameters": {
        "*.attention.w[qkv].weight": "colwise",
        "*.attention.wo.weight": "rowwise",
        "*.feed_forward.w[13].weight": "colwise",
        "*.feed_forward.w2.weight": "rowwise",
        "*": "R",
    },
}
"""The Megatron plan of ``layout-prop gen llama`` (mesh dp=2, sp=2, tp=2) for :func:`llama_onnx`."""


def llama_onnx(layers: int = 1, batch: int = 2, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int = 64,
               seed: int = 0, dynamic_batch: bool = False, rsqrt_as_div: bool = False):
    """An ``onnx.ModelProto`` of ``layers`` Llama decoder layers (see the module docstring).

    Inputs ``x (B, S, H)``, ``cos`` and ``sin (1, S, D)``; output ``out (B, S, H)``.
    ``dynamic_batch`` writes B as a named dynamic dim; ``rsqrt_as_div`` writes the inverse
    root as ``Div(x, Sqrt(.))`` instead of ``Mul(x, Reciprocal(Sqrt(.)))``.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    nodes: list = []
    inits: list = []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(name: str, shape) -> str:
        scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 1.0
        value = rng.standard_normal(shape).astype(np.float32) * scale if len(shape) == 2 else \
            (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return const(name, value)

    def node(op: str, inputs: list[str], name: str, outputs: int = 1, **attrs) -> str | list[str]:
        outs = [f"{name}_output_{i}" for i in range(outputs)]
        nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs[0] if outputs == 1 else outs

    const("eps", np.array(1e-6, np.float32))
    const("two", np.array(2.0, np.float32))
    const("one", np.array(1.0, np.float32))
    const("scale", np.array(1.0 / np.sqrt(head_dim), np.float32))
    const("mask", np.triu(np.full((1, 1, seq, seq), np.finfo(np.float32).min, np.float32), 1))
    const("axis_last", np.array([-1], np.int64))
    const("zero_i", np.array(0, np.int64))
    const("axes_0", np.array([0], np.int64))
    const("axes_1", np.array([1], np.int64))
    const("tail_heads", np.array([seq, heads, head_dim], np.int64))
    const("merged", np.array([batch, seq, hidden], np.int64))
    const("heads_shape", np.array([batch, seq, heads, head_dim], np.int64))
    for name, value in (("starts_lo", [0]), ("ends_lo", [head_dim // 2]), ("starts_hi", [head_dim // 2]),
                        ("ends_hi", [np.iinfo(np.int64).max]), ("axes_3", [3])):
        const(name, np.array(value, np.int64))

    def rms_norm(x: str, w: str, p: str) -> str:
        sq = node("Pow", [x, "two"], f"{p}/Pow")
        mean = node("ReduceMean", [sq], f"{p}/ReduceMean", axes=[-1], keepdims=1)
        e = node("Add", [mean, "eps"], f"{p}/Add")
        root = node("Sqrt", [e], f"{p}/Sqrt")
        if rsqrt_as_div:
            y = node("Div", [x, root], f"{p}/Div")
        else:
            inv = node("Reciprocal", [root], f"{p}/Reciprocal")
            y = node("Mul", [x, inv], f"{p}/Mul")
        return node("Mul", [w, y], f"{p}/Mul_1")

    def rotate_half(x: str, p: str) -> str:
        x1 = node("Slice", [x, "starts_lo", "ends_lo", "axes_3"], f"{p}/Slice")
        x2 = node("Slice", [x, "starts_hi", "ends_hi", "axes_3"], f"{p}/Slice_1")
        neg = node("Neg", [x2], f"{p}/Neg")
        return node("Concat", [neg, x1], f"{p}/Concat", axis=-1)

    cos = node("Unsqueeze", ["cos", "axes_1"], "/rope/Unsqueeze")
    sin = node("Unsqueeze", ["sin", "axes_1"], "/rope/Unsqueeze_1")
    x = "x"
    for i in range(layers):
        p = f"/layers.{i}"
        w = f"layers.{i}."
        h = rms_norm(x, weight(w + "attention_norm.weight", [hidden]), f"{p}/attention_norm")
        bnsd = {}
        for name in ("q", "k", "v"):
            lin = node("MatMul", [h, weight(w + f"attention.w{name}.weight", [hidden, hidden])],
                       f"{p}/attention/w{name}/MatMul")
            if name == "q":  # the view's shape from a shape subgraph, as the exporter writes q.view(bsz, ...)
                shape = node("Shape", [h], f"{p}/attention/Shape")
                bsz = node("Gather", [shape, "zero_i"], f"{p}/attention/Gather", axis=0)
                bsz1 = node("Unsqueeze", [bsz, "axes_0"], f"{p}/attention/Unsqueeze")
                target = node("Concat", [bsz1, "tail_heads"], f"{p}/attention/Concat", axis=0)
            else:
                target = "heads_shape"
            split = node("Reshape", [lin, target], f"{p}/attention/Reshape_{name}")
            bnsd[name] = node("Transpose", [split], f"{p}/attention/Transpose_{name}", perm=[0, 2, 1, 3])
        rot = {}
        for name in ("q", "k"):
            a = node("Mul", [bnsd[name], cos], f"{p}/attention/rope_{name}/Mul")
            b = node("Mul", [rotate_half(bnsd[name], f"{p}/attention/rope_{name}"), sin],
                     f"{p}/attention/rope_{name}/Mul_1")
            rot[name] = node("Add", [a, b], f"{p}/attention/rope_{name}/Add")
        kt = node("Transpose", [rot["k"]], f"{p}/attention/Transpose_kt", perm=[0, 1, 3, 2])
        scores = node("MatMul", [rot["q"], kt], f"{p}/attention/MatMul")
        scaled = node("Mul", [scores, "scale"], f"{p}/attention/Mul")
        masked = node("Add", [scaled, "mask"], f"{p}/attention/Add")
        probs = node("Softmax", [masked], f"{p}/attention/Softmax", axis=-1)
        ctx = node("MatMul", [probs, bnsd["v"]], f"{p}/attention/MatMul_1")
        bsnd = node("Transpose", [ctx], f"{p}/attention/Transpose_out", perm=[0, 2, 1, 3])
        merged = node("Reshape", [bsnd, "merged"], f"{p}/attention/Reshape_out")
        proj = node("MatMul", [merged, weight(w + "attention.wo.weight", [hidden, hidden])],
                    f"{p}/attention/wo/MatMul")
        x1 = node("Add", [x, proj], f"{p}/Add")
        h2 = rms_norm(x1, weight(w + "ffn_norm.weight", [hidden]), f"{p}/ffn_norm")
        gate = node("MatMul", [h2, weight(w + "feed_forward.w1.weight", [hidden, ffn])], f"{p}/feed_forward/w1/MatMul")
        sig = node("Sigmoid", [gate], f"{p}/feed_forward/Sigmoid")
        act = node("Mul", [gate, sig], f"{p}/feed_forward/Mul")
        up = node("MatMul", [h2, weight(w + "feed_forward.w3.weight", [hidden, ffn])], f"{p}/feed_forward/w3/MatMul")
        glu = node("Mul", [act, up], f"{p}/feed_forward/Mul_1")
        down = node("MatMul", [glu, weight(w + "feed_forward.w2.weight", [ffn, hidden])],
                    f"{p}/feed_forward/w2/MatMul")
        x = node("Add", [x1, down], f"{p}/Add_1")
    nodes.append(helper.make_node("Identity", [x], ["out"], name="/Identity"))
    b = "batch" if dynamic_batch else batch
    graph = helper.make_graph(
        nodes, "llama", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, seq, hidden]),
                         helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, seq, head_dim]),
                         helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, seq, head_dim])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [b, seq, hidden])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
