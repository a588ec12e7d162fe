"""Importing MindSpore cells and MindIR files: a MindFormers-style Llama block with a Megatron
plan gives gen llama's collectives and matches one device; malformed files are one line."""

from __future__ import annotations

import copy
import json
import re
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mindspore")

from layout_prop.api import analyze  # noqa: E402
from layout_prop.cli import main  # noqa: E402
from layout_prop.core.errors import SpecError  # noqa: E402
from layout_prop.frontends.mindspore import from_cell, from_mindir  # noqa: E402
from layout_prop.frontends.samples import LLAMA_PLAN  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.frontends.generate import llama_spec  # noqa: E402
from layout_prop.runner import execute_global, run_graph  # noqa: E402

from .mindspore_llama import Model, example_inputs, graph_mode  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_block.mindir"

PLAN = LLAMA_PLAN  # the cell takes cos and sin as (1, S, D), as the ONNX sample does: one plan for both


def moves(graph):
    a = analyze(graph, reshard=True)
    assert a.ok
    return [(s["kind"], s["mesh_axis"], s["bytes_per_rank"]) for r in a.report()["redistributions"]
            for s in r["steps"]]


@pytest.fixture(scope="module", autouse=True)
def _graph_mode():
    """Every test here exports in GRAPH_MODE (where shard() strategies are kept); later modules get the mode back."""
    with graph_mode():
        yield


@pytest.fixture(scope="module")
def block():
    return from_cell(Model(), *example_inputs(), plan=PLAN)


def test_cell_llama_block_gives_gen_llamas_collectives(block):
    generated = load_spec(llama_spec(1))
    assert moves(block) == moves(generated)
    assert moves(block) == [("all-gather", "tp", 256), ("all-gather", "sp", 256), ("all-gather", "sp", 256),
                            ("reduce-scatter", "tp", 256), ("all-gather", "tp", 256), ("reduce-scatter", "tp", 256)]
    assert Counter(v.code for v in analyze(block).check.violations) == \
        Counter(v.code for v in analyze(generated).check.violations)


def test_cell_llama_block_has_gen_llamas_structure_and_the_users_names(block):
    ops = Counter(n.op for n in block.nodes if not n.is_input)
    generated = load_spec(llama_spec(1))
    # gen llama's ops, and the two expand_dims that make cos and sin (1, 1, S, D)
    assert ops == Counter(n.op for n in generated.nodes if not n.is_input) + Counter({"unsqueeze": 2})
    names = [n.name for n in block.inputs()]
    assert names[:3] == ["x", "cos", "sin"] and "layers.0.attention.wq.weight" in names
    assert block.node("layers.0.attention.wq.weight").attrs["placements"] == ("R", "R", "S(0)")  # Dense: (out, in)
    assert block.node("layers.0.attention.wo.weight").attrs["placements"] == ("R", "R", "S(1)")
    assert block.node("layers.0.attention.wq").op == "linear"
    assert next(n for n in block.nodes if n.op == "rms_norm").attrs["eps"] == 1e-6


def test_cell_llama_block_run_backward_matches_one_device(block):
    rep = run_graph(block, backward=True, seed=3)
    assert rep.ok, rep.mismatches
    assert "layers.0.feed_forward.w2.weight" in rep.grads


def test_rowwise_q_gives_what_the_hand_written_spec_gives():
    plan = copy.deepcopy(PLAN)
    plan["parameters"] = {"*.attention.wq.weight": "rowwise", **plan["parameters"]}
    imported = from_mindir(EXAMPLE, plan)
    spec = llama_spec(1)
    spec["inputs"]["model.layers.0.self_attn.q_proj.weight"]["placements"] = ["R", "R", "S(1)"]  # (out, in): in on tp
    hand = load_spec(spec)
    a, b = analyze(imported), analyze(hand)
    # the same violations and moves (the cell lists q's reshape and rope before k's linear: another order)
    assert Counter((v.code, v.op, v.operand) for v in a.check.violations) == \
        Counter((v.code, v.op, v.operand) for v in b.check.violations)
    assert sorted(moves(imported)) == sorted(moves(hand))
    assert sorted(moves(hand)) != sorted(moves(load_spec(llama_spec(1))))


def test_from_cell_removes_its_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    from_cell(Model(), *example_inputs(), plan=PLAN)
    assert list(tmp_path.iterdir()) == []


def test_the_example_mindir_through_the_command_line(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN, sort_keys=False))
    assert main(["check", str(EXAMPLE), "--plan", str(plan), "--reshard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_bytes_per_rank"] == 6 * 256
    out = tmp_path / "spec.json"
    assert main(["import", str(EXAMPLE), "--plan", str(plan), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["check", str(out), "--reshard", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report


def test_malformed_mindir_files_are_one_line(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN, sort_keys=False))
    data = EXAMPLE.read_bytes()
    for name, content in (("truncated.mindir", data[:len(data) // 3]), ("wrong.mindir", b"\x89PNG\r\n" * 40),
                          ("empty.mindir", b"")):
        path = tmp_path / name
        path.write_bytes(content)
        assert main(["check", str(path), "--plan", str(plan)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "bad-model" in err and "Traceback" not in err, err
    with pytest.raises(SpecError) as err:
        from_mindir(tmp_path / "missing.mindir", PLAN)
    assert err.value.code == "model-not-found"


def test_another_format_named_mindir_is_bad_model_naming_the_format(tmp_path, capsys):
    """Other protobuf files may parse as MindIR (an ONNX model does, with nodes): they are refused
    as not MindIR, not read as a graph without inputs."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from layout_prop.frontends.mindspore import _schema

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"mesh": {"shape": [2], "names": ["tp"]}}))
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "xy")
    onnx_model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
    onnx_as_mindir = tmp_path / "relu.mindir"
    onnx.save(onnx_model, str(onnx_as_mindir))
    assert main(["import", str(onnx_as_mindir), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad-model" in err and "ONNX" in err and "file_format='MINDIR'" in err, err
    unversioned = _schema().ModelProto()
    unversioned.ParseFromString(EXAMPLE.read_bytes())
    unversioned.ClearField("ir_version")
    path = tmp_path / "unversioned.mindir"
    path.write_bytes(unversioned.SerializeToString())
    assert main(["import", str(path), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad-model" in err and "no ir_version" in err, err


def test_shard_strategies_are_compared_with_the_plan(tmp_path):
    from .mindspore_cells import ShardedMatMul

    import mindspore as ms
    import numpy as np

    cell = ShardedMatMul()
    x = ms.Tensor(np.ones((4, 8), np.float32))
    agree = {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": ["S(0)"]}, "parameters": {"w": ["S(1)"]}}
    graph = from_cell(cell, x, plan=agree)
    assert not [n for n in graph.meta["import_notes"] if "shard()" in n]
    differ = {"mesh": {"shape": [2], "names": ["tp"]}, "inputs": {"x": ["S(0)"]}, "parameters": {"w": "R"}}
    notes = from_cell(cell, x, plan=differ).meta["import_notes"]
    (note,) = notes  # x agrees (rows on tp), w does not
    assert re.fullmatch(r"MindSpore shard\(\) of node MatMul splits input 1 \(w\) as \(1, 2\), but the plan "
                        r"gives w \['R'\], which splits it as \(1, 1\)", note), note


def test_a_mix_of_primitives_imports_and_matches_one_device():
    from .mindspore_cells import Mixed

    import mindspore as ms
    import numpy as np

    ids = ms.Tensor(np.zeros((2, 8), np.int32))
    plan = {"mesh": {"shape": [2, 2], "names": ["dp", "tp"]}, "inputs": {"ids": ["S(0)", "R"]},
            "parameters": {"tok.embedding_table": "vocab", "fc.weight": "colwise", "fc.bias": ["R", "S(0)"],
                           "*": "R"}}
    graph = from_cell(Mixed(), ids, plan=plan)
    ops = Counter(n.op for n in graph.nodes if not n.is_input)
    assert ops == {"reshape": 2, "embedding": 1, "linear": 1, "add": 2, "layer_norm": 1, "split2": 1,
                   "gelu_erf": 1, "mul": 1, "sigmoid": 1, "slice": 1, "sum": 1, "mean": 1, "log_softmax": 1}
    assert graph.node("tok.embedding_table").attrs["placements"] == ("R", "S(0)")  # rows on tp
    assert graph.node("fc.weight").attrs["placements"] == ("R", "S(0)")  # (out, in): out on tp
    assert graph.node("norm/LayerNorm").attrs["eps"] == 1e-7
    assert graph.node("StridedSlice").attrs == {"axis": 1, "start": 0, "stop": 4}
    a = analyze(graph, reshard=True)
    assert a.ok
    rep = run_graph(graph, backward=True)
    assert rep.ok, rep.mismatches


def test_layout_prop_analyze_takes_an_imported_cell(block):
    import layout_prop

    a = layout_prop.analyze(block, reshard=True)
    assert a.ok and a.report()["total_bytes_per_rank"] == 6 * 256


INT32_MAX = 2 ** 31 - 1


def attention_node(graph):
    """The one node of an imported attention cell."""
    (node,) = [n for n in graph.nodes if not n.is_input]
    return node


def test_flash_attention_score_imports_as_flash_attention_score_with_its_attrs():
    from .mindspore_cells import FlashAttention

    import mindspore as ms
    import numpy as np

    q = ms.Tensor(np.ones((2, 4, 8, 8), np.float32))
    plan = {"mesh": {"shape": [2], "names": ["sp"]}, "inputs": {name: ["S(2)"] for name in "qkv"}}
    graph = from_cell(FlashAttention(), q, q, q, plan=plan)
    attn = attention_node(graph)
    # sparse_mode 2 ignores the compressed 2048 x 2048 causal mask: not an operand
    assert (attn.op, attn.inputs, attn.attrs) == ("flash_attention_score", ("q", "k", "v"), {
        "head_num": 4, "input_layout": "BNSD", "scale": 0.35, "keep_prob": 1.0, "sparse_mode": 2,
        "pre_tokens": INT32_MAX, "next_tokens": INT32_MAX})
    a = analyze(graph, reshard=True)
    assert [(r["input"], [s["kind"] for s in r["steps"]]) for r in a.report()["redistributions"]] == [
        ("k", ["all-gather"]), ("v", ["all-gather"])]  # each rank's query rows need every key and value
    rep = run_graph(graph, backward=True)
    assert rep.ok, rep.mismatches


@pytest.mark.parametrize("head_num, shapes, keywords, placements, attrs, operands", [
    # BSH, 4 query heads of 8 over 2 kv heads (GQA), bottom-right causal, dropout; query heads on tp
    (4, [(2, 8, 32), (2, 8, 16), (2, 8, 16)], {"scalar_value": 0.5, "input_layout": "BSH", "sparse_mode": 3,
                                               "keep_prob": 0.9}, ["S(2)", "R", "R"],
     {"input_layout": "BSH", "scale": 0.5, "keep_prob": 0.9, "sparse_mode": 3}, 3),
    # TND: packed sequences with their constant cumulative ends; tokens on cp
    (2, [(9, 2, 4), (7, 1, 4), (7, 1, 4)], {"input_layout": "TND", "sparse_mode": 3, "actual_seq_qlen": (2, 5, 9),
                                            "actual_seq_kvlen": (3, 4, 7)}, ["S(0)", "R", "R"],
     {"input_layout": "TND", "scale": 1.0, "keep_prob": 1.0, "sparse_mode": 3, "actual_seq_qlen": [2, 5, 9],
      "actual_seq_kvlen": [3, 4, 7]}, 3),
    # SBH, the band from the bottom-right; batch on dp
    (2, [(4, 2, 8)] * 3, {"input_layout": "SBH", "sparse_mode": 4, "pre_tokens": 1, "next_tokens": 1},
     ["S(1)", "S(1)", "S(1)"], {"input_layout": "SBH", "scale": 1.0, "keep_prob": 1.0, "sparse_mode": 4,
                                "pre_tokens": 1, "next_tokens": 1}, 3),
    # BSND, sparse_mode 0: the band and attn_mask, the fourth operand; query rows on sp
    (2, [(2, 8, 2, 4)] * 3, {"input_layout": "BSND", "sparse_mode": 0, "pre_tokens": 3, "next_tokens": 0},
     ["S(1)", "R", "R"], {"input_layout": "BSND", "scale": 1.0, "keep_prob": 1.0, "sparse_mode": 0,
                          "pre_tokens": 3, "next_tokens": 0}, 4),
])
def test_flash_attention_score_attrs_carry_over_and_the_import_runs_on_two_ranks(head_num, shapes, keywords,
                                                                                 placements, attrs, operands):
    from .mindspore_cells import FlashAttentionOf

    import mindspore as ms
    import numpy as np

    mask = ms.Tensor(np.triu(np.ones((8, 8), np.bool_), 1)) if operands == 4 else None
    tensors = [ms.Tensor(np.ones(shape, np.float32)) for shape in shapes]
    plan = {"mesh": {"shape": [2], "names": ["x"]}, "inputs": dict(zip("qkv", ([p] for p in placements)))}
    graph = from_cell(FlashAttentionOf(head_num, mask, **keywords), *tensors, plan=plan)
    attn = attention_node(graph)
    assert attn.op == "flash_attention_score" and len(attn.inputs) == operands
    assert attn.attrs == {"head_num": head_num, "pre_tokens": INT32_MAX, "next_tokens": INT32_MAX, **attrs}
    notes = graph.meta["import_notes"]
    if attrs["keep_prob"] != 1.0:
        assert notes == ["node FlashAttentionScore (FlashAttentionScore) drops probabilities (keep_prob=0.9): its "
                         "draws are layout-prop's (the same on every layout), not MindSpore's drop_mask"]
    rep = run_graph(graph, backward=True)
    assert rep.ok, rep.mismatches or rep.violations


@pytest.mark.parametrize("sparse_mode, mask_shape", [(0, (2, 1, 8, 8)), (1, (8, 8))])
def test_a_uint8_attn_mask_imports_as_bool(sparse_mode, mask_shape):
    """MindSpore's attn_mask is bool or uint8 (1: masked), uint8 in MindFormers; a constant uint8 mask was
    read as a graph input of dtype uint8, which no spec takes (bad-dtype at inputs.CNode_N.dtype)."""
    from .mindspore_cells import FlashAttentionOf

    import mindspore as ms
    import numpy as np

    mask = ms.Tensor(np.triu(np.ones(mask_shape, np.uint8), 1))
    t = ms.Tensor(np.ones((2, 8, 16), np.float32))
    plan = {"mesh": {"shape": [2], "names": ["sp"]}, "inputs": {name: ["S(1)"] for name in "qkv"}}
    graph = from_cell(FlashAttentionOf(2, mask, input_layout="BSH", sparse_mode=sparse_mode), t, t, t, plan=plan)
    attn = attention_node(graph)
    assert len(attn.inputs) == 4
    (mask_input,) = [n for n in graph.inputs() if n.name == attn.inputs[3]]
    assert (mask_input.attrs["dtype"], tuple(mask_input.attrs["shape"])) == ("bool", mask_shape)
    rep = run_graph(graph, backward=True)
    assert rep.ok, rep.mismatches or rep.violations


def test_flash_attention_score_forms_it_cannot_take_are_unmapped_with_a_note_saying_why():
    from layout_prop.core.errors import OpError

    from .mindspore_cells import FlashAttentionOf, FlashAttentionWithShift

    import mindspore as ms
    import numpy as np

    t = ms.Tensor(np.ones((2, 4, 2, 4), np.float32))
    plan = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {name: ["S(0)"] for name in "qkv"}}
    prefix = FlashAttentionOf(2, input_layout="BSND", sparse_mode=5, prefix=(1, 1))
    with pytest.raises(OpError) as err:  # the output is still found (output 3), as unmapped
        from_cell(prefix, t, t, t, plan=plan)
    assert err.value.code == "unknown-op" and "FlashAttentionScore (x1" in err.value.message
    graph = from_cell(prefix, t, t, t, plan=plan, opaque=True)
    assert (attention_node(graph).op, attention_node(graph).attrs["shape"]) == ("opaque", [2, 4, 2, 4])
    assert graph.meta["import_notes"][0] == (
        "node FlashAttentionScore (FlashAttentionScore) is left unmapped: sparse_mode 5 (5 to 8: a prefix or a "
        "varlen variant) is not one flash_attention_score takes (0 band, 1 attn_mask only, 2 top-left causal, 3 "
        "bottom-right causal, 4 band from the bottom-right)")
    plan["inputs"]["shift"] = ["S(0)"]
    t = ms.Tensor(np.ones((2, 2, 4, 4), np.float32))  # BNSD, 2 heads
    graph = from_cell(FlashAttentionWithShift(), t, t, t, t, plan=plan, opaque=True)
    assert graph.meta["import_notes"][0] == (
        "node FlashAttentionScore (FlashAttentionScore) is left unmapped: it adds a real_shift (a positional bias "
        "on the scores), which flash_attention_score does not take")


def test_a_cell_returning_a_tuple_has_both_outputs():
    from .mindspore_cells import TwoOutputs

    import mindspore as ms
    import numpy as np

    graph = from_cell(TwoOutputs(), ms.Tensor(np.ones((4, 2), np.float32)),
                      plan={"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"x": ["S(0)"]}})
    assert [graph.producer(v)[0].op for v in graph.outputs] == ["exp", "neg"]


def test_mindformers_decomposed_rms_norm_fuses():
    from .mindspore_cells import DecomposedRMSNorm

    import mindspore as ms
    import numpy as np

    graph = from_cell(DecomposedRMSNorm(), ms.Tensor(np.ones((2, 4, 16), np.float32)),
                      plan={"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"x": ["S(0)"]}})
    (norm,) = [n for n in graph.nodes if not n.is_input]
    assert (norm.op, norm.inputs, norm.attrs["eps"]) == ("rms_norm", ("x", "weight"), 1e-5)


def test_tile_and_broadcast_to_repeat_kv_heads():
    from .mindspore_cells import RepeatKV

    import mindspore as ms
    import numpy as np

    k = np.random.default_rng(0).standard_normal((2, 1, 4, 8)).astype(np.float32)
    graph = from_cell(RepeatKV(), ms.Tensor(k), plan={"mesh": {"shape": [2], "names": ["dp"]},
                                                      "inputs": {"k": ["S(0)"]}})
    ops = Counter(n.op for n in graph.nodes if not n.is_input)
    assert ops["concat"] == 2 and "tile" not in ops and "expand" not in ops
    a = analyze(graph)
    (got,) = execute_global(a.graph, {"k": k}, wanted=a.graph.outputs).values()
    np.testing.assert_allclose(got, 2 * np.repeat(k, 2, axis=1), rtol=1e-6)
    assert run_graph(graph, backward=True).ok


def test_a_flash_attention_llama_is_searched_as_the_fused_one():
    """MindFormers writes attention as FlashAttentionScore (causal by sparse mode 2); imported as
    flash_attention_score, the search reads the same model from it as from the matmul-softmax cell."""
    from layout_prop.planner.search import _recognise_imported

    flash = from_cell(Model(2, flash=True), *example_inputs(), plan=PLAN)
    plain = from_cell(Model(2), *example_inputs(), plan=PLAN)
    assert {n.op for n in flash.nodes} >= {"flash_attention_score"}
    assert "scaled_dot_product_attention" not in {n.op for n in flash.nodes}
    assert _recognise_imported(flash) == _recognise_imported(plain)
    assert _recognise_imported(flash).layers == 2


def _unmapped_flash_attention(form):
    """A cell whose FlashAttentionScore the importer leaves unmapped, its example inputs and the reason."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    from .mindspore_cells import FlashAttentionOf, FlashAttentionWithShift

    class RunTimeEnds(nn.Cell):
        """TND attention whose cumulative sequence ends are an input: known only at run time."""

        def construct(self, q, k, v, ends):
            return ops.flash_attention_score(q, k, v, 2, input_layout="TND", sparse_mode=3, actual_seq_qlen=ends,
                                             actual_seq_kvlen=ends)

    if form == "sparse mode 5":
        t = ms.Tensor(np.ones((2, 4, 2, 4), np.float32))
        return FlashAttentionOf(2, input_layout="BSND", sparse_mode=5, prefix=(1, 1)), (t, t, t), (
            "sparse_mode 5 (5 to 8: a prefix or a varlen variant) is not one flash_attention_score takes (0 band, 1 "
            "attn_mask only, 2 top-left causal, 3 bottom-right causal, 4 band from the bottom-right)")
    if form == "real_shift":
        t = ms.Tensor(np.ones((2, 2, 4, 4), np.float32))
        return FlashAttentionWithShift(), (t, t, t, t), (
            "it adds a real_shift (a positional bias on the scores), which flash_attention_score does not take")
    t = ms.Tensor(np.ones((9, 2, 4), np.float32))
    return RunTimeEnds(), (t, t, t, ms.Tensor(np.array([2, 5, 9], np.int64))), (
        "its actual_seq_qlen is a tensor computed at run time, where flash_attention_score takes constants")


@pytest.mark.parametrize("form", ["sparse mode 5", "real_shift", "run-time sequence ends"])
def test_an_unmapped_flash_attention_score_says_why_in_the_one_line_error(form, tmp_path, capsys):
    """The unknown-op line names the reason (the one the import note gives with --opaque), not only the op."""
    import mindspore as ms

    cell, tensors, why = _unmapped_flash_attention(form)
    ms.export(cell, *tensors, file_name=str(tmp_path / "attention"), file_format="MINDIR")
    model = str(tmp_path / "attention.mindir")
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"mesh": {"shape": [2], "names": ["dp"]}}))
    for command in ("import", "check"):
        assert main([command, model, "--plan", str(plan)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"unknown-op: {2 if form.startswith('run-time') else 1} op type(s) the importer cannot map:" in err
        assert f"FlashAttentionScore (x1, first FlashAttentionScore: {why})" in err, err
        assert "(hint: pass --opaque to treat each as a barrier" in err, err
    assert main(["import", model, "--plan", str(plan), "--opaque", "-o", str(tmp_path / "spec.json")]) == 0
    assert f"note: node FlashAttentionScore (FlashAttentionScore) is left unmapped: {why}\n" in \
        capsys.readouterr().err


def _two_unknown_ops():
    """x -> Dropout (two outputs, both read) -> Abs -> add: two op types the importer left unmapped."""
    from layout_prop.frontends.ir import WHY_UNMAPPED, MNode, ModelGraph, Value

    model = ModelGraph("onnx")
    for name in ("x", "y", "mask", "z", "w"):
        model.add_value(Value(name, (4,), "float32"))
    model.inputs, model.outputs = ["x"], ["w"]
    model.nodes = [MNode("drop", "unmapped:Dropout", ["x"], ["y", "mask"], {}, "Dropout"),
                   MNode("abs", "unmapped:Abs", ["y"], ["z"], {WHY_UNMAPPED: "its x is complex"}, "Abs"),
                   MNode("add", "add", ["z", "mask"], ["w"], {}, "Add")]
    return model


def test_the_unknown_op_hint_offers_opaque_only_for_the_ops_it_keeps():
    """--opaque keeps an op of one output; one of several is still unknown-op with --opaque, whose hint
    said to pass --opaque (both frontends share this error)."""
    from layout_prop.core.errors import OpError
    from layout_prop.frontends.ir import to_spec

    with pytest.raises(OpError) as err:
        to_spec(_two_unknown_ops())
    assert err.value.code == "unknown-op"
    assert err.value.message == ("2 op type(s) the importer cannot map: Dropout (x1, first drop), "
                                 "Abs (x1, first abs: its x is complex)")
    assert err.value.hint == (
        "pass --opaque to treat the others as barriers (inputs gathered, output replicated); --opaque keeps only an "
        "op with one output as a barrier, and Dropout (first drop) has 2 outputs: write the model with supported ops")
    with pytest.raises(OpError) as err:
        to_spec(_two_unknown_ops(), opaque=True)
    assert err.value.message == "1 op type(s) the importer cannot map: Dropout (x1, first drop)"
    assert err.value.hint == ("--opaque keeps only an op with one output as a barrier, and Dropout (first drop) has "
                              "2 outputs: write the model with supported ops")


def test_the_unknown_op_line_names_each_distinct_reason_up_to_three():
    from layout_prop.core.errors import OpError
    from layout_prop.frontends.ir import WHY_UNMAPPED, MNode, ModelGraph, Value, to_spec

    model = ModelGraph("mindir")
    model.add_value(Value("x", (4,), "float32"))
    model.inputs = ["x"]
    reasons = ["sparse_mode 5", "sparse_mode 5", "sparse_mode 6", "a real_shift", "sparse_mode 7", "sparse_mode 8"]
    prev = "x"
    for i, why in enumerate(reasons):
        model.add_value(Value(f"a{i}", (4,), "float32"))
        model.nodes.append(MNode(f"fa{i}", "unmapped:FlashAttentionScore", [prev], [f"a{i}"], {WHY_UNMAPPED: why},
                                 "FlashAttentionScore"))
        prev = f"a{i}"
    model.outputs = [prev]
    with pytest.raises(OpError) as err:
        to_spec(model)
    assert err.value.message == (
        "1 op type(s) the importer cannot map: FlashAttentionScore (x6, first fa0: sparse_mode 5; sparse_mode 6; "
        "a real_shift; 2 more reason(s) in the import notes (--opaque))")
