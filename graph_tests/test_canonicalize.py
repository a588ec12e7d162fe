"""The canonicalisation pass: each rewrite fires on the pattern exporters write, not on a near
miss, and the fused graph computes what the model computes (onnx's reference evaluator)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from layout_prop.api import analyze  # noqa: E402
from layout_prop.frontends.ir import MNode, ModelGraph, Value, apply_plan, sanitize, to_spec  # noqa: E402
from layout_prop.frontends.onnx import from_onnx, read_onnx  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.frontends.canonicalize import REWRITES, Canonicalize  # noqa: E402
from layout_prop.io.plan_file import load_plan  # noqa: E402
from layout_prop.runner import execute_global, run_graph  # noqa: E402

B, N, S, D = 2, 2, 4, 8
PLAN = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"x": ["S(0)"]}}


def model(nodes, inputs, output_shape, inits=(), opset=17):
    """A one-output ONNX model; ``inputs`` maps names to shapes, ``inits`` are (name, array)."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def ops_of(m, plan=PLAN, fuse=True):
    return Counter(n.op for n in from_onnx(m, plan, fuse=fuse).nodes if not n.is_input)


def assert_same_numbers(m, plan=PLAN, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in m.graph.input}
    (want,) = ReferenceEvaluator(m).run(None, feeds)
    # the model's weights, and the constants the reader derives from them (a cache gathered at position ids)
    inits = {sanitize(name): v.const for name, v in read_onnx(m, load_plan(plan)).values.items() if v.const is not None}
    a = analyze(from_onnx(m, plan))
    inputs = {n.name: feeds.get(n.name, inits.get(n.name)) for n in a.graph.inputs()}
    (got,) = execute_global(a.graph, inputs, wanted=a.graph.outputs).values()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_interleaved_rope_as_torch_writes_it_fuses_to_mode_1():
    half = D // 2
    inits = [("s0", np.array([0])), ("s1", np.array([1])), ("e", np.array([D])), ("ax", np.array([3])),
             ("st", np.array([2])), ("last", np.array([-1])), ("shape", np.array([B, N, S, D]))]
    nodes = [
        helper.make_node("Slice", ["x", "s0", "e", "ax", "st"], ["even"]),   # x[..., ::2]
        helper.make_node("Slice", ["x", "s1", "e", "ax", "st"], ["odd"]),    # x[..., 1::2]
        helper.make_node("Neg", ["odd"], ["neg"]),
        helper.make_node("Unsqueeze", ["neg", "last"], ["c0"]),
        helper.make_node("Unsqueeze", ["even", "last"], ["c1"]),
        helper.make_node("Concat", ["c0", "c1"], ["pairs"], axis=-1),        # torch.stack((-odd, even), -1)
        helper.make_node("Reshape", ["pairs", "shape"], ["rot"]),            # .flatten(-2)
        helper.make_node("Mul", ["x", "cos"], ["a"]),
        helper.make_node("Mul", ["rot", "sin"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    m = model(nodes, {"x": [B, N, S, D], "cos": [1, 1, S, D], "sin": [1, 1, S, D]}, [B, N, S, D], inits)
    g = from_onnx(m, PLAN)
    (rope,) = [n for n in g.nodes if not n.is_input]
    assert (rope.op, rope.attrs["mode"], half) == ("rotary_position_embedding", 1, 4)
    assert_same_numbers(m)


def _attention(mask_nodes, mask_inits, fill_first: bool | None = None):
    scale = np.array(1 / np.sqrt(D), np.float32)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Div", ["s", "root"], ["sc"]), *mask_nodes,
             helper.make_node("Softmax", ["z"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    inits = [("root", np.array(np.sqrt(D), np.float32)), *mask_inits]
    shapes = {"q": [B, N, S, D], "k": [B, N, S, D], "v": [B, N, S, D]}
    return model(nodes, shapes, [B, N, S, D], inits), scale


@pytest.mark.parametrize("form", ["add", "where-keep", "where-fill"])
def test_attention_with_a_causal_mask_fuses(form):
    causal = np.tril(np.ones((S, S), bool))
    if form == "add":
        nodes = [helper.make_node("Add", ["sc", "mask"], ["z"])]
        inits = [("mask", np.where(causal, 0, -np.inf).astype(np.float32)[None, None])]
    elif form == "where-keep":   # where(keep, scores, -inf)
        nodes = [helper.make_node("Where", ["keep", "sc", "fill"], ["z"])]
        inits = [("keep", causal), ("fill", np.array(-np.inf, np.float32))]
    else:                        # scores.masked_fill(mask, min): where(masked, min, scores)
        nodes = [helper.make_node("Where", ["masked", "fill", "sc"], ["z"])]
        inits = [("masked", ~causal), ("fill", np.array(np.finfo(np.float32).min, np.float32))]
    m, scale = _attention(nodes, inits)
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"q": ["S(0)"], "k": ["S(0)"], "v": ["S(0)"]}}
    g = from_onnx(m, plan)
    (attn,) = [n for n in g.nodes if not n.is_input]
    assert attn.op == "scaled_dot_product_attention" and attn.attrs["causal"] is True
    assert attn.attrs["scale"] == pytest.approx(float(scale))
    assert_same_numbers(m, plan)


def test_attention_with_another_mask_is_left_as_it_is():
    mask = np.triu(np.full((S, S), -np.inf, np.float32), 2)  # a sliding pattern, not top-left causal
    m, _ = _attention([helper.make_node("Add", ["sc", "mask"], ["z"])], [("mask", mask)])
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"q": ["S(0)"], "k": ["S(0)"], "v": ["S(0)"]}}
    assert ops_of(m, plan) == {"transpose": 1, "batch_matmul": 2, "scale": 1, "add": 1, "softmax": 1}
    assert [n.name for n in from_onnx(m, plan).inputs()] == ["q", "k", "v", "mask"]  # the mask kept as an input


def test_rms_norm_needs_its_exact_pattern():
    # x * x for the square, 1 / sqrt: fused; a mean over another dim: not
    for dims, fused in (([-1], True), ([1], False)):
        g = ModelGraph("test")
        for name, shape in (("x", (2, 4, 8)), ("w", (8,)), ("sq", (2, 4, 8)), ("m", (2, 4, 1) if dims == [-1] else
                            (2, 1, 8)), ("e", None), ("r", None), ("i", None), ("n", (2, 4, 8)), ("y", (2, 4, 8))):
            g.add_value(Value(name, shape or g.values["m"].shape, "float32"))
        g.add_value(Value("eps", (), "float32", const=np.array(1e-5, np.float32)))
        g.add_value(Value("one", (), "float32", const=np.array(1.0, np.float32)))
        g.values["w"].weight = True
        g.inputs, g.outputs = ["x", "w"], ["y"]
        g.nodes = [MNode("sq", "mul", ["x", "x"], ["sq"]), MNode("m", "mean", ["sq"], ["m"], {"dims": dims,
                                                                                          "keepdim": True}),
                   MNode("e", "add", ["m", "eps"], ["e"]), MNode("r", "sqrt", ["e"], ["r"]),
                   MNode("i", "div", ["one", "r"], ["i"]), MNode("n", "mul", ["x", "i"], ["n"]),
                   MNode("y", "mul", ["n", "w"], ["y"])]
        result = Canonicalize().run(g)
        assert ("rms_norm" in result.fused) is fused
        if fused:
            assert [(n.op, n.inputs, n.attrs["eps"]) for n in g.nodes] == [("rms_norm", ["x", "w"], 1e-05)]


def test_silu_mul_fuses_only_a_single_use_silu():
    nodes = [helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["a", "s"], ["t"]),
             helper.make_node("Mul", ["t", "b"], ["u"]), helper.make_node("Add", ["u", "t"], ["y"])]
    m = model(nodes, {"a": [4, 8], "b": [4, 8]}, [4, 8])
    plan = {"mesh": {"shape": [2], "names": ["dp"]}}
    assert ops_of(m, plan) == {"silu": 1, "mul": 1, "add": 1}  # silu(a) is used twice: no silu_mul
    nodes[-1] = helper.make_node("Identity", ["u"], ["y"])
    assert ops_of(model(nodes, {"a": [4, 8], "b": [4, 8]}, [4, 8]), plan) == {"silu_mul": 1}
    assert_same_numbers(model(nodes, {"a": [4, 8], "b": [4, 8]}, [4, 8]), plan)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_the_standard_rotary_embedding_op(interleaved):
    nodes = [helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], interleaved=interleaved)]
    m = model(nodes, {"x": [B, N, S, D], "cos": [B, S, D // 2], "sin": [B, S, D // 2]}, [B, N, S, D], opset=23)
    rope = next(n for n in from_onnx(m, PLAN).nodes if n.op == "rotary_position_embedding")
    assert rope.attrs["mode"] == interleaved
    expected = {"concat": 2, "unsqueeze": 2, "rotary_position_embedding": 1}
    assert ops_of(m) == (expected if not interleaved else dict(expected, unsqueeze=4, reshape=2))
    assert_same_numbers(m)


def test_the_standard_rotary_embedding_op_with_constant_position_ids():
    cache = np.random.default_rng(2).standard_normal((16, D // 2)).astype(np.float32)
    inits = [("cos_cache", cache), ("sin_cache", cache[::-1].copy()), ("pos", np.array([[3, 4, 5, 6]] * B))]
    nodes = [helper.make_node("RotaryEmbedding", ["x", "cos_cache", "sin_cache", "pos"], ["y"])]
    m = model(nodes, {"x": [B, N, S, D]}, [B, N, S, D], inits, opset=23)
    assert ops_of(m)["rotary_position_embedding"] == 1
    assert_same_numbers(m)


def _graph(m, plan, rewrites):
    """``from_onnx`` with only ``rewrites`` (``()``: nothing fused)."""
    g = read_onnx(m, load_plan(plan))
    Canonicalize(rewrites).run(g)
    spec, weights = to_spec(g)
    return load_spec(apply_plan(spec, weights, load_plan(plan)))


def test_fusion_does_not_change_what_check_reports():
    """rotate-half RoPE, attention and silu * up, fused and unfused: with the heads on tp and the
    batch on dp, the same verdict and no moves either way; with the sequence on tp, both are
    fixed by --reshard but the unfused chain costs more (reshard plans it op by op)."""
    half = D // 2
    inits = [("lo", np.array([0])), ("mid", np.array([half])), ("hi", np.array([D])), ("ax", np.array([3])),
             ("root", np.array(np.sqrt(D), np.float32))]
    nodes = []
    for t in ("q", "k"):
        nodes += [helper.make_node("Slice", [t, "lo", "mid", "ax"], [f"{t}1"]),
                  helper.make_node("Slice", [t, "mid", "hi", "ax"], [f"{t}2"]),
                  helper.make_node("Neg", [f"{t}2"], [f"{t}n"]),
                  helper.make_node("Concat", [f"{t}n", f"{t}1"], [f"{t}r"], axis=-1),
                  helper.make_node("Mul", [t, "cos"], [f"{t}a"]), helper.make_node("Mul", [f"{t}r", "sin"], [f"{t}b"]),
                  helper.make_node("Add", [f"{t}a", f"{t}b"], [f"{t}_rot"])]
    nodes += [helper.make_node("Transpose", ["k_rot"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q_rot", "kt"], ["s"]), helper.make_node("Div", ["s", "root"], ["sc"]),
              helper.make_node("Softmax", ["sc"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Sigmoid", ["o"], ["g"]), helper.make_node("Mul", ["o", "g"], ["act"]),
              helper.make_node("Mul", ["act", "v"], ["y"])]
    shapes = {"q": [B, N, S, D], "k": [B, N, S, D], "v": [B, N, S, D], "cos": [1, 1, S, D], "sin": [1, 1, S, D]}
    m = model(nodes, shapes, [B, N, S, D], inits)
    for names, places in ((["dp", "tp"], {"q": ["S(0)", "S(1)"], "k": ["S(0)", "S(1)"], "v": ["S(0)", "S(1)"]}),
                          (["tp"], {"q": ["S(2)"], "k": ["S(2)"], "v": ["S(2)"], "cos": ["S(2)"],
                                    "sin": ["S(2)"]})):
        plan = {"mesh": {"shape": [2] * len(names), "names": names}, "inputs": places}
        assert ops_of(m, plan)["scaled_dot_product_attention"] == 1
        fused, unfused = _graph(m, plan, REWRITES), _graph(m, plan, ())
        assert Counter(n.op for n in unfused.nodes)["slice"] == 4  # really unfused
        done = [analyze(g, reshard=True).report() for g in (fused, unfused)]
        assert done[0]["ok"] and done[1]["ok"]
        assert analyze(fused).ok == analyze(unfused).ok
        moved = [sorted((s["kind"], s["mesh_axis"], s["bytes_per_rank"]) for r in d["redistributions"]
                        for s in r["steps"] if s["kind"] != "local-slice") for d in done]
        if names == ["dp", "tp"]:
            assert moved[0] == moved[1] == []
        else:
            # NOT the same: the reshard pass plans the fused attention as one op (k and v whole, or q, k
            # and v moved to shard the heads), the unfused chain op by op: k^T gathered for q @ k^T, p moved
            # to shard the contracted key dim, so that p @ v is a partial sum to reduce (1088 bytes when
            # this was written, against 512 or less fused)
            totals = [d["total_bytes_per_rank"] for d in done]
            assert 0 < totals[0] < totals[1], totals
            assert ("all-reduce", "tp", 512) in moved[1]
    assert_same_numbers(m, plan)


def test_read_onnx_keeps_the_decomposed_ops_until_canonicalize():
    from layout_prop.frontends.samples import LLAMA_PLAN, llama_onnx
    from layout_prop.io.plan_file import load_plan

    g = read_onnx(llama_onnx(), load_plan(LLAMA_PLAN))
    before = Counter(n.op for n in g.nodes)
    assert before["pow"] == 2 and before["reciprocal"] == 2 and before["sigmoid"] == 1 and before["softmax"] == 1
    assert "Shape" not in {n.source for n in g.nodes}  # the shape subgraph folded while reading
    result = Canonicalize().run(g)
    assert result.fused == {"identity": 1, "silu": 1, "rms_norm": 2, "rope": 2, "silu_mul": 1, "attention": 1}


def test_the_com_microsoft_rotary_embedding_maps_like_the_standard_one():
    cache = np.random.default_rng(2).standard_normal((16, D // 2)).astype(np.float32)
    pos = np.array([[3, 4, 5, 6]] * B)
    inits = [numpy_helper.from_array(cache, "cos_cache"), numpy_helper.from_array(cache[::-1].copy(), "sin_cache"),
             numpy_helper.from_array(pos, "pos")]
    x = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, N, S, D])]
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, N, S, D])]
    ms_node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos_cache", "sin_cache"], ["y"], domain="com.microsoft")
    microsoft = helper.make_model(helper.make_graph([ms_node], "g", x, y, inits),
                                  opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    std_node = helper.make_node("RotaryEmbedding", ["x", "cos_cache", "sin_cache", "pos"], ["y"])
    standard = helper.make_model(helper.make_graph([std_node], "g", x, y, inits),
                                 opset_imports=[helper.make_opsetid("", 23)])
    graphs = [from_onnx(m, PLAN) for m in (microsoft, standard)]
    assert [[(n.op, n.attrs) for n in g.nodes] for g in graphs][0] == [[(n.op, n.attrs) for n in g.nodes]
                                                                       for g in graphs][1]
    # the position-gathered caches are the same constants either way
    values = [{k: v.const for k, v in read_onnx(m, load_plan(PLAN)).values.items() if v.const is not None
               and k.endswith("_cache") and v.const.shape == (B, S, D // 2)} for m in (microsoft, standard)]
    assert len(values[0]) == 2 and all(np.array_equal(a, b) for a, b in zip(values[0].values(), values[1].values()))


def test_attention_as_torch_exports_sdpa_fuses():
    """F.scaled_dot_product_attention(is_causal=True) through torch.onnx.export (opset 17): q and k^T
    each scaled by sqrt(scale), a causal mask from Where on a constant."""
    root = np.array(D ** -0.25, np.float32)
    causal = np.tril(np.ones((S, S), bool))
    nodes = [helper.make_node("Mul", ["q", "root"], ["qs"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Mul", ["kt", "root"], ["kts"]),
             helper.make_node("MatMul", ["qs", "kts"], ["s"]),
             helper.make_node("Where", ["keep", "zero", "ninf"], ["mask"]),
             helper.make_node("Add", ["s", "mask"], ["z"]),
             helper.make_node("Softmax", ["z"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    inits = [("root", root), ("keep", causal), ("zero", np.array(0, np.float32)),
             ("ninf", np.array(-np.inf, np.float32))]
    m = model(nodes, {"q": [B, N, S, D], "k": [B, N, S, D], "v": [B, N, S, D]}, [B, N, S, D], inits)
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"q": ["S(0)"], "k": ["S(0)"], "v": ["S(0)"]}}
    (attn,) = [n for n in from_onnx(m, plan).nodes if not n.is_input]
    assert attn.op == "scaled_dot_product_attention" and attn.attrs["causal"] is True
    assert attn.attrs["scale"] == pytest.approx(1 / np.sqrt(D))
    assert_same_numbers(m, plan)


@pytest.mark.parametrize("causal", [0, 1])
def test_the_opset_23_attention_op(causal):
    nodes = [helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=causal, scale=0.25)]
    m = model(nodes, {"q": [B, N, S, D], "k": [B, N, S, D], "v": [B, N, S, D]}, [B, N, S, D], opset=23)
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"q": ["S(0)"], "k": ["S(0)"], "v": ["S(0)"]}}
    (attn,) = [n for n in from_onnx(m, plan).nodes if not n.is_input]
    assert (attn.op, attn.attrs["causal"], attn.attrs["scale"]) == ("scaled_dot_product_attention", bool(causal), 0.25)
    assert_same_numbers(m, plan)


def test_rms_norm_in_float32_between_casts_as_hugging_face_writes_it():
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    nodes = [helper.make_node("Cast", ["x"], ["x32"], to=f32),
             helper.make_node("Pow", ["x32", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["m"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["m", "eps"], ["e"]), helper.make_node("Sqrt", ["e"], ["r"]),
             helper.make_node("Div", ["one", "r"], ["i"]), helper.make_node("Mul", ["x32", "i"], ["n"]),
             helper.make_node("Cast", ["n"], ["n16"], to=f16), helper.make_node("Mul", ["w", "n16"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f16, [2, 4, 8])],
        [helper.make_tensor_value_info("y", f16, [2, 4, 8])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two"), numpy_helper.from_array(np.array(1e-6, np.float32),
                                                                                            "eps"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one"),
         numpy_helper.from_array((1 + 0.1 * np.arange(8)).astype(np.float16), "w")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"x": ["S(0)"]}}
    (norm,) = [n for n in from_onnx(m, plan).nodes if not n.is_input]
    assert (norm.op, norm.inputs, norm.attrs["eps"]) == ("rms_norm", ("x", "w"), 1e-6)
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float16)
    (want,) = ReferenceEvaluator(m).run(None, {"x": x})
    a = analyze(from_onnx(m, plan))
    (got,) = execute_global(a.graph, {"x": x, "w": (1 + 0.1 * np.arange(8)).astype(np.float16)},
                            wanted=a.graph.outputs).values()
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_grouped_query_attention_with_repeat_kv():
    """Hugging Face's repeat_kv (k[:, :, None].expand(B, n_kv, n_rep, S, D).reshape(B, n_kv * n_rep, S, D))
    before eager attention: the expand becomes copies, the attention fuses, numbers match."""
    kv = 1
    shape5 = np.array([B, kv, N // kv, S, D], np.int64)
    shape4 = np.array([B, N, S, D], np.int64)
    nodes = []
    for t in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [t, "two"], [f"{t}5"]),
                  helper.make_node("Expand", [f"{t}5", "shape5"], [f"{t}x"]),
                  helper.make_node("Reshape", [f"{t}x", "shape4"], [f"{t}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "c"], ["sc"]),
              helper.make_node("Add", ["sc", "mask"], ["z"]), helper.make_node("Softmax", ["z"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vr"], ["y"])]
    inits = [("two", np.array([2])), ("shape5", shape5), ("shape4", shape4), ("c", np.array(D ** -0.5, np.float32)),
             ("mask", np.triu(np.full((S, S), -np.inf, np.float32), 1))]
    m = model(nodes, {"q": [B, N, S, D], "k": [B, kv, S, D], "v": [B, kv, S, D]}, [B, N, S, D], inits)
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"q": ["S(0)"], "k": ["S(0)"], "v": ["S(0)"]}}
    ops = ops_of(m, plan)
    assert ops["scaled_dot_product_attention"] == 1 and ops["concat"] == 2 and "expand" not in ops
    assert_same_numbers(m, plan)
    rep = run_graph(from_onnx(m, plan), backward=True)
    assert rep.ok, rep.mismatches
