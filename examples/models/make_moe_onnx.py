"""Write ``moe.onnx``, a Mixture-of-Experts layer written by hand with ``onnx.helper`` (issue #28, item 4).

Both torch exporters fail on Hugging Face's Mixtral (TorchScript on ``aten::diff``, dynamo on the
grouped-mm experts), so this layer is the importer's MoE fixture.  It is a Mixtral-style sparse
block on ``x`` of shape (batch 2, sequence 8, hidden 16), 16 tokens, 4 SwiGLU experts of width 32,
top-2 routing, no token dropped, written the way a static-shape (GShard-style) export lays it out:

1. router: ``probs = Softmax(MatMul(x, gate))``; ``TopK(probs, 2)``; the two weights renormalised
   to sum to 1 (``Div`` by their ``ReduceSum``);
2. dispatch: each of the 32 (token, choice) pairs goes to the slot (expert, position), its position
   among its expert's pairs counted in token order (``OneHot`` of the chosen experts, an exclusive
   ``CumSum`` over the pairs, the pair's own column picked with ``GatherElements``, ``Concat`` into
   index pairs); the tokens (``Gather`` by a constant token index) are written to their slots of a
   zero buffer (E, C, H) with ``ScatterND``; the capacity C is the token count, so no slot is
   shared and no token is dropped;
3. experts: batched ``MatMul`` of the buffer with the stacked weights w1, w3 (E, H, F) and w2
   (E, F, H): ``w2(silu(x w1) * x w3)``, SiLU as ``Mul(g, Sigmoid(g))``;
4. combine: each pair's expert output read back from its slot (``GatherND``), times its routing
   weight, added into its token's row with ``ScatterElements`` (reduction add).

No arithmetic on integer constants (a slot is an index pair, not ``expert * C + position``): the
importer makes every constant a spec input, and ``layout-prop run`` feeds the inputs random values.

Run by hand (only ``onnx`` and ``numpy`` needed) from the repository root::

    .venv/bin/python examples/models/make_moe_onnx.py

The weights are drawn from ``numpy.random.default_rng(SEED)``; the file is deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "moe.onnx"
SEED = 0
BATCH, SEQ, HIDDEN, EXPERTS, TOP_K, FFN = 2, 8, 16, 4, 2, 32
TOKENS = BATCH * SEQ
CAPACITY = TOKENS  # an expert receives each token at most once: no token is ever dropped
OPSET = 18  # ScatterND's and ScatterElements' reduction attribute (16 and up); ReduceSum's axes input (13 and up)


def weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The layer's parameters, Mixtral's names (``gate`` is the router), drawn at 1/sqrt(fan-in)."""
    def draw(shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    return {"moe.gate.weight": draw((HIDDEN, EXPERTS), HIDDEN),
            "moe.experts.w1": draw((EXPERTS, HIDDEN, FFN), HIDDEN),
            "moe.experts.w3": draw((EXPERTS, HIDDEN, FFN), HIDDEN),
            "moe.experts.w2": draw((EXPERTS, FFN, HIDDEN), FFN)}


def constants() -> dict[str, np.ndarray]:
    """The layer's constant tensors: shapes, axes, the token of each (token, choice) pair, zero buffers."""
    pairs = TOKENS * TOP_K
    token_of_pair = np.repeat(np.arange(TOKENS, dtype=np.int64), TOP_K)  # pair p = (token p // k, choice p % k)
    return {
        "k": np.array([TOP_K], np.int64),
        "sum_axes": np.array([1], np.int64),
        "tokens_shape": np.array([TOKENS, HIDDEN], np.int64),
        "pairs_shape": np.array([pairs], np.int64),
        "pair_column": np.array([pairs, 1], np.int64),
        "depth": np.array(EXPERTS, np.int64),
        "one_hot_values": np.array([0, 1], np.int64),
        "zero_axis": np.array(0, np.int64),
        "token_of_pair": token_of_pair,
        "token_rows": np.repeat(token_of_pair[:, None], HIDDEN, axis=1),  # ScatterElements' index (pairs, H)
        "empty_slots": np.zeros((EXPERTS, CAPACITY, HIDDEN), np.float32),
        "empty_tokens": np.zeros((TOKENS, HIDDEN), np.float32),
        "out_shape": np.array([BATCH, SEQ, HIDDEN], np.int64),
    }


def build(seed: int = SEED):
    """The layer as an ``onnx.ModelProto`` (checked by ``onnx.checker``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    params = weights(rng)
    node = helper.make_node
    nodes = [node("Constant", [], [name], name=f"/moe/{name}", value=numpy_helper.from_array(value, name))
             for name, value in constants().items()]
    nodes += [
        # router: softmax over the experts, top-2, the two weights renormalised
        node("Reshape", ["x", "tokens_shape"], ["tokens"], name="/moe/flatten"),
        node("MatMul", ["tokens", "moe.gate.weight"], ["router_logits"], name="/moe/gate/MatMul"),
        node("Softmax", ["router_logits"], ["router_probs"], name="/moe/Softmax", axis=1),
        node("TopK", ["router_probs", "k"], ["top_probs", "top_experts"], name="/moe/TopK", axis=1),
        node("ReduceSum", ["top_probs", "sum_axes"], ["top_sum"], name="/moe/ReduceSum", keepdims=1),
        node("Div", ["top_probs", "top_sum"], ["route_weights"], name="/moe/renormalise"),
        # dispatch: each (token, choice) pair to the slot (expert, its position among the expert's pairs)
        node("Reshape", ["top_experts", "pairs_shape"], ["pair_expert"], name="/moe/pair_expert"),
        node("OneHot", ["pair_expert", "depth", "one_hot_values"], ["expert_mask"], name="/moe/OneHot", axis=-1),
        node("CumSum", ["expert_mask", "zero_axis"], ["expert_position"], name="/moe/CumSum", exclusive=1),
        node("Reshape", ["pair_expert", "pair_column"], ["pair_expert_column"], name="/moe/pair_expert_column"),
        node("GatherElements", ["expert_position", "pair_expert_column"], ["pair_position"],
             name="/moe/GatherElements", axis=1),
        node("Concat", ["pair_expert_column", "pair_position"], ["pair_slot"], name="/moe/slot", axis=1),
        node("Gather", ["tokens", "token_of_pair"], ["pair_tokens"], name="/moe/Gather_tokens", axis=0),
        node("ScatterND", ["empty_slots", "pair_slot", "pair_tokens"], ["expert_in"], name="/moe/dispatch"),
        # the experts, batched over E: w2(silu(x w1) * (x w3))
        node("MatMul", ["expert_in", "moe.experts.w1"], ["gate_proj"], name="/moe/experts/w1/MatMul"),
        node("Sigmoid", ["gate_proj"], ["gate_sigmoid"], name="/moe/experts/Sigmoid"),
        node("Mul", ["gate_proj", "gate_sigmoid"], ["gate_silu"], name="/moe/experts/silu"),
        node("MatMul", ["expert_in", "moe.experts.w3"], ["up_proj"], name="/moe/experts/w3/MatMul"),
        node("Mul", ["gate_silu", "up_proj"], ["expert_hidden"], name="/moe/experts/Mul"),
        node("MatMul", ["expert_hidden", "moe.experts.w2"], ["expert_out"], name="/moe/experts/w2/MatMul"),
        # combine: each pair's output read from its slot, weighted, added into its token's row
        node("GatherND", ["expert_out", "pair_slot"], ["pair_out"], name="/moe/GatherND"),
        node("Reshape", ["route_weights", "pair_column"], ["pair_weight"], name="/moe/pair_weight"),
        node("Mul", ["pair_out", "pair_weight"], ["pair_weighted"], name="/moe/weighted"),
        node("ScatterElements", ["empty_tokens", "token_rows", "pair_weighted"], ["combined"], name="/moe/combine",
             axis=0, reduction="add"),
        node("Reshape", ["combined", "out_shape"], ["y"], name="/moe/unflatten"),
    ]
    graph = helper.make_graph(
        nodes, "moe_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        initializer=[numpy_helper.from_array(value, name) for name, value in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="layout-prop make_moe_onnx.py")
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> None:
    import onnx

    onnx.save(build(), str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
