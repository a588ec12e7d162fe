"""bfloat16 everywhere a dtype goes: specs, bytes, kernels (through float32), run, plan, estimate, ONNX.

The numpy kernels compute in float32 and round each bfloat16 output once
(:func:`layout_prop.engines.simulator.call_kernel`); what that computes is checked against
float64 on the same (bfloat16) inputs, not only against itself, and the sharded run against
one device within bfloat16's tolerance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import LayoutError
from layout_prop.core.spec import check_dtype, numpy_dtype
from layout_prop.engines.simulator import call_kernel
from layout_prop.io.loader import load_spec
from layout_prop.runner import TOLERANCES, execute_global, random_inputs, run_graph

LLAMA = Path(__file__).resolve().parent.parent / "examples" / "llama_block.yaml"
BF16 = numpy_dtype("bfloat16")


def llama_text(dtype: str) -> str:
    return LLAMA.read_text().replace("dtype: float32", f"dtype: {dtype}")


def test_bfloat16_is_a_dtype_of_two_bytes():
    graph = analyze(load_spec(llama_text("bfloat16"))).graph
    specs = [s for n in graph.nodes for s in n.meta["specs"] if s is not None]
    assert {s.dtype for s in specs} == {"bfloat16"} and {s.itemsize for s in specs} == {2}
    assert check_dtype(BF16) == "bfloat16"
    with pytest.raises(LayoutError) as err:
        check_dtype("float8")
    assert err.value.code == "bad-dtype" and "bfloat16" in err.value.hint


def test_call_kernel_computes_in_float32_and_rounds_to_nearest_even():
    """1 + 2^-8 lies halfway between the bfloat16 neighbours 1 and 1 + 2^-7: it rounds to the even 1;
    1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6, and rounds to the even 1 + 2^-6."""
    one = np.ones(2, np.float32).astype(BF16)
    steps = np.array([2.0 ** -8, 3 * 2.0 ** -8], np.float32)  # float32 arguments: exact
    seen = []
    out = call_kernel(lambda a, b: seen.append((a.dtype, b.dtype)) or a + b, [one, steps], {}, ["bfloat16"])
    assert seen == [(np.float32, np.float32)]  # the kernel never sees bfloat16
    assert out.dtype == BF16 and out.astype(np.float64).tolist() == [1.0, 1.0 + 2.0 ** -6]
    cast = call_kernel(lambda a, dtype: a.astype(dtype), [one], {"dtype": "bfloat16"}, ["bfloat16"])
    assert cast.dtype == BF16


def test_one_device_in_bfloat16_is_float64_on_the_same_inputs_within_bfloat16_rounding():
    """The Llama block's forward and backward on one device, bfloat16 against float64 fed the
    same (bfloat16) values: the float32 compute path computes the op, not something else."""
    bf = analyze(load_spec(llama_text("bfloat16")), backward=True).graph
    f64 = analyze(load_spec(llama_text("float64")), backward=True).graph
    inputs = random_inputs(bf, seed=0)
    wide = {name: a.astype(np.float64) for name, a in inputs.items()}
    got = execute_global(bf, inputs, wanted=bf.outputs)
    want = execute_global(f64, wide, wanted=f64.outputs)
    assert len(got) > 10
    for name in bf.outputs:
        assert got[name].dtype == BF16, name
        g, w = got[name].astype(np.float64), want[name]
        assert np.abs(g - w).max() <= 3e-2 * np.abs(w).max(), name


def test_the_sharded_llama_block_in_bfloat16_matches_one_device_forward_and_backward(capsys):
    graph = load_spec(llama_text("bfloat16"))
    report = run_graph(graph, backward=True, seed=1)
    assert report.ok, report.mismatches
    assert len(report.grads) == 10  # x and the 9 weights
    worst = max(e["max_rel_err"] for table in (report.outputs, report.grads) for e in table.values())
    assert 0 < worst <= TOLERANCES["bfloat16"]  # rounding differs (partial sums are rounded), within tolerance


def test_run_on_the_command_line_and_its_bytes(tmp_path, capsys):
    bf, f32 = tmp_path / "bf16.yaml", tmp_path / "f32.yaml"
    bf.write_text(llama_text("bfloat16"))
    f32.write_text(llama_text("float32"))
    assert main(["run", str(bf), "--backward", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["ok"] and len(ran["grads"]) == 10
    assert main(["run", str(f32), "--backward", "--json"]) == 0
    ran32 = json.loads(capsys.readouterr().out)
    assert [c["bytes_per_rank"] * 2 for c in ran["collectives"]] == [c["bytes_per_rank"] for c in ran32["collectives"]]
    assert main(["check", str(bf), "--backward", "--reshard", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert main(["check", str(f32), "--backward", "--reshard", "--json"]) == 0
    checked32 = json.loads(capsys.readouterr().out)
    assert checked["memory_per_rank"]["total"] * 2 == checked32["memory_per_rank"]["total"]


def test_estimate_prices_bfloat16_at_its_peak(tmp_path, capsys):
    """a100-80g: 312 TFLOP/s in bfloat16, 156 in float32; half the bytes."""
    out = {}
    for dtype in ("bfloat16", "float32"):
        path = tmp_path / f"{dtype}.yaml"
        path.write_text(llama_text(dtype))
        assert main(["estimate", str(path), "--cluster", "a100-80g", "--json"]) == 0
        out[dtype] = json.loads(capsys.readouterr().out)
    assert out["bfloat16"]["compute_s"] == pytest.approx(out["float32"]["compute_s"] / 2, rel=1e-9)
    assert out["bfloat16"]["memory_per_rank_bytes"] * 2 == out["float32"]["memory_per_rank_bytes"]


MLP_AUTO = """\
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [8, 16], placements: ["S(0)", R], dtype: bfloat16}
  w: {shape: [16, 32], placements: auto, dtype: bfloat16}
  w2: {shape: [32, 16], placements: auto, dtype: bfloat16}
nodes:
  - {name: h, op: matmul, inputs: [x, w]}
  - {name: a, op: relu, inputs: [h]}
  - {name: y, op: matmul, inputs: [a, w2]}
outputs: [y]
"""


def test_plan_fills_auto_layouts_of_a_bfloat16_spec_and_the_plan_runs(tmp_path, capsys):
    pytest.importorskip("scipy")
    spec, planned = tmp_path / "auto.yaml", tmp_path / "planned.yaml"
    spec.write_text(MLP_AUTO)
    assert main(["plan", str(spec), "-o", str(planned)]) == 0
    capsys.readouterr()
    assert "auto" not in planned.read_text() and planned.read_text().count("bfloat16") == 3
    assert main(["run", str(planned), "--backward"]) == 0
    out = capsys.readouterr().out
    assert "grad w2:" in out and out.strip().endswith("matches one device")


def bfloat16_onnx_model():
    """relu(x @ w) @ w2, every tensor BFLOAT16 (the initialisers stored as raw bfloat16)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 6)) / 3).astype(np.float32).astype(BF16)
    w2 = (rng.standard_normal((6, 8)) / 3).astype(np.float32).astype(BF16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["a"], name="act"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4, 8])],
                              initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def test_an_onnx_model_in_bfloat16_imports_checks_and_runs(tmp_path, capsys):
    """Imported as bfloat16, computed on its own weights as onnx's ReferenceEvaluator does (within
    bfloat16 rounding), and its sharded forward and backward match one device."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    from layout_prop.commands.run import load_with_weights
    from layout_prop.runner import check_given_inputs

    model = bfloat16_onnx_model()
    path, plan = tmp_path / "bf16.onnx", tmp_path / "plan.yaml"
    onnx.save(model, str(path))
    plan.write_text("mesh: {shape: [2, 2], names: [dp, tp]}\ninputs: {x: ['S(0)', R]}\n"
                    "parameters: {w: colwise, w2: rowwise}\n")
    assert main(["import", str(path), "--plan", str(plan), "-o", str(tmp_path / "spec.json")]) == 0
    spec = json.loads((tmp_path / "spec.json").read_text())
    assert {k: v["dtype"] for k, v in spec["inputs"].items()} == {"x": "bfloat16", "w": "bfloat16", "w2": "bfloat16"}

    from argparse import Namespace

    graph, weights, _ = load_with_weights(Namespace(spec=str(path), plan=str(plan), opaque=False))
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32).astype(BF16)
    a = analyze(graph)
    (got,) = execute_global(a.graph, check_given_inputs(a.graph, {**weights, "x": x}), wanted=a.graph.outputs).values()
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert got.dtype == BF16 and want.dtype == BF16
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.abs(g - w).max() <= 2e-2 * np.abs(w).max()

    capsys.readouterr()
    assert main(["run", str(path), "--plan", str(plan), "--backward"]) == 0
    out = capsys.readouterr().out
    assert "grad x:" in out and "grad w:" in out and "grad w2:" in out and out.strip().endswith("matches one device")


def test_run_inputs_takes_bfloat16_as_numpy_saves_it_and_as_float32(tmp_path, capsys):
    """np.savez writes an ml_dtypes.bfloat16 array as 2-byte voids: read back as bfloat16, bit for
    bit; float32 values are rounded to bfloat16."""
    from layout_prop.runner import check_given_inputs

    graph = load_spec("mesh: {shape: [2]}\ninputs: {x: {shape: [3], dtype: bfloat16}}\nnodes: []")
    x = np.array([1.0, -2.5, 3.140625], np.float32).astype(BF16)
    path = tmp_path / "x.npz"
    np.savez(path, x=x)
    stored = np.load(path, allow_pickle=False)["x"]
    assert stored.dtype.kind == "V"
    back = check_given_inputs(graph, {"x": stored})["x"]
    assert back.dtype == BF16 and back.tobytes() == x.tobytes()
    rounded = check_given_inputs(graph, {"x": np.array([1.0, 1.00390625, 3.14159], np.float32)})["x"]
    assert rounded.astype(np.float64).tolist() == [1.0, 1.0, 3.140625]


def test_mindspore_kernels_take_bfloat16_through_float32():
    """The MindSpore table: bfloat16 arguments become float32 tensors (MindSpore's CPU MatMul has no
    bfloat16), a cast to bfloat16 is mindspore.bfloat16; rounded, the products equal numpy's path."""
    pytest.importorskip("mindspore")
    from layout_prop.kernels import mindspore_backend as ms_kernels
    from layout_prop.kernels.numpy_backend import KERNELS

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32).astype(BF16)
    w = rng.standard_normal((8, 6)).astype(np.float32).astype(BF16)
    for name, args, attrs in (("matmul", [x, w], {}), ("softmax", [x], {"axis": -1})):
        got = ms_kernels.to_numpy(ms_kernels.KERNELS[name](*args, **attrs)).astype(BF16)
        want = call_kernel(KERNELS[name], args, attrs, ["bfloat16"])
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2 ** -7, atol=2 ** -12)
    values = rng.standard_normal(5).astype(np.float32)
    cast = ms_kernels.to_numpy(ms_kernels.KERNELS["cast"](values, dtype="bfloat16"))
    assert cast.dtype == BF16 and cast.tobytes() == values.astype(BF16).tobytes()


MLP_TP = """\
mesh: {shape: [2], names: [tp]}
inputs:
  x: {shape: [4, 16], placements: [R], dtype: bfloat16}
  w: {shape: [16, 32], placements: ["S(1)"], dtype: bfloat16}
  w2: {shape: [32, 16], placements: ["S(0)"], dtype: bfloat16}
nodes:
  - {name: h, op: matmul, inputs: [x, w]}
  - {name: a, op: gelu, inputs: [h]}
  - {name: y, op: matmul, inputs: [a, w2]}
  - {name: z, op: softmax, inputs: [y], attrs: {axis: -1}}
outputs: [z]
"""


def test_the_mindspore_engine_runs_bfloat16_forward_and_backward(tmp_path, capsys):
    """Two msrun workers: the row-parallel sum (and the backward's all-reduces) move bfloat16 bits, the MindSpore
    kernels compute in float32 and round each output; the run matches one device and says how it computed."""
    pytest.importorskip("mindspore")
    import shutil

    if shutil.which("msrun") is None and not (Path(sys.executable).parent / "msrun").exists():
        pytest.skip("msrun is not installed")
    path = tmp_path / "bf16.yaml"
    path.write_text(MLP_TP)
    assert main(["run", str(path), "--engine", "mindspore", "--backward", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and set(report["grads"]) == {"x", "w", "w2"}
    assert report["compute_notes"] and "bfloat16 is computed in float32" in report["compute_notes"][0]
    assert {c["kind"] for c in report["collectives"]} >= {"all-reduce"}
    assert all(c["bytes_per_rank"] % 2 == 0 for c in report["collectives"])
    assert any(e["kind"] == "all-reduce" for e in report["emulated_collectives"])  # no native bfloat16 all-reduce
    errors = [e["max_abs_err"] for e in list(report["outputs"].values()) + list(report["grads"].values())]
    assert 0 < max(errors) < 8e-2  # bfloat16 rounding, not bit for bit (MindSpore's float32 kernels sum in their order)


@pytest.mark.parametrize("placements", [["P(sum)", "S(0)"], ["P(max)", "P(sum)"], ["P(avg)", "R"], ["P(min)", "S(1)"]])
def test_partial_bfloat16_inputs_are_cut_into_terms_that_reduce_to_the_value_exactly(placements):
    """The simulator cuts a Partial bfloat16 input in float32 with random terms, keeping the plain
    split (value and identity) where a term would not be a bfloat16: the terms reduce back exactly,
    for values from 1e-4 to 1e2, and most elements keep random terms on several ranks."""
    from layout_prop.core.layout import Layout
    from layout_prop.core.mesh import DeviceMesh
    from layout_prop.core.spec import TensorSpec
    from layout_prop.engines.collectives import assemble
    from layout_prop.engines.simulator import _cut_bfloat16

    spec = TensorSpec((6, 5), "bfloat16", Layout(DeviceMesh((2, 2), ("a", "b")), placements, 2))
    value = (np.random.default_rng(0).standard_normal((6, 5)) * np.logspace(-4, 2, 5)).astype(np.float32)
    value = value.astype(BF16).astype(np.float32)
    pieces = _cut_bfloat16(value, spec, np.random.default_rng(1))
    assert {p.dtype for p in pieces} == {BF16}
    wide = TensorSpec(spec.shape, "float32", spec.layout)
    assert (assemble([p.astype(np.float32) for p in pieces], wide) == value).all()


#: op-database records run in bfloat16 (their float32 operands): Partial and sharded operands of
#: products, reductions, norms, softmax, the order ops (ties), division
BFLOAT16_RECORDS = ("linalg-matmul", "linalg-sum", "rms_norm", "softmax", "div", "prod", "topk", "mul")


@pytest.mark.parametrize("name", BFLOAT16_RECORDS)
def test_op_database_records_in_bfloat16_match_one_device(name):
    """verify_op on the record's samples with float32 operands made bfloat16, (2,) and (2, 2), 20
    combinations a sample and mesh, forward and backward: every accepted or resharded combination
    equals one device within bfloat16's tolerance."""
    import dataclasses

    from layout_prop.testing import verify_op
    from layout_prop.testing.opdb import all_records

    (record,) = [r for r in all_records() if r.name == name]
    samples = [dataclasses.replace(s, dtypes=["bfloat16" if d == "float32" else d
                                              for d in (s.dtypes or ["float32"] * len(s.shapes))])
               for s in record.samples]
    report = verify_op(record.op, samples, meshes=((2,), (2, 2)), placements=20, backward=record.backward,
                       codes=record.codes, shrink_limit=0)
    assert report.ok, [m for m in report.mismatches[:2]]
    assert report.accepted + report.resharded > 0


def test_a_mindspore_cell_in_bfloat16_imports_with_its_weights(tmp_path, capsys):
    """A cell with a bfloat16 parameter, exported to MindIR and read back: the input and the
    weight are bfloat16, the weight's bits are the cell's, and run --backward matches one device."""
    ms = pytest.importorskip("mindspore")
    from mindspore import Parameter, Tensor, nn, ops

    from layout_prop.frontends.mindspore import read_mindir

    weights = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)

    class Scale(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(weights, ms.bfloat16), name="w")

        def construct(self, x):
            return ops.mul(x, self.w)

    ms.export(Scale(), Tensor(np.ones((4, 8), np.float32), ms.bfloat16), file_name=str(tmp_path / "scale"),
              file_format="MINDIR")
    model = read_mindir(tmp_path / "scale.mindir")
    assert model.values["x"].dtype == "bfloat16" and model.values["w"].dtype == "bfloat16"
    assert model.values["w"].const.tobytes() == weights.astype(BF16).tobytes()
    plan = tmp_path / "plan.yaml"
    plan.write_text("mesh: {shape: [2], names: [tp]}\ninputs: {x: ['S(0)']}\nparameters: {w: ['S(0)']}\n")
    assert main(["run", str(tmp_path / "scale.mindir"), "--plan", str(plan), "--backward"]) == 0
    out = capsys.readouterr().out
    assert "inputs: 1 the model's own, 1 drawn at random ('x')" in out and "grad w:" in out


@pytest.mark.parametrize("model, mesh, plan", [("llama", "dp=1,sp=2,tp=2", True), ("gpt", "dp=1,sp=2,tp=2", False),
                                               ("moe", "dp=1,ep=2,tp=2", False)])
def test_gen_writes_bfloat16_specs_that_check_plan_and_run(model, mesh, plan, tmp_path, capsys):
    """``gen MODEL --dtype bfloat16``: every float value bfloat16; check --reshard moves half float32's bytes for
    each float redistribution (token ids stay int64); run --backward matches one device; and (Llama: plan takes
    seconds) plan fills the layer's weights given as auto, the planned spec still bfloat16 and running --backward."""
    import yaml

    specs = {}
    for dtype in ("bfloat16", "float32"):
        specs[dtype] = tmp_path / f"{dtype}.yaml"
        assert main(["gen", model, "--mesh", mesh, "--dtype", dtype, "-o", str(specs[dtype])]) == 0
    capsys.readouterr()
    reports = {}
    for dtype, path in specs.items():
        assert main(["check", str(path), "--reshard", "--backward", "--json"]) == 0
        reports[dtype] = json.loads(capsys.readouterr().out)
    tensors = reports["bfloat16"]["tensors"]
    assert {t["dtype"] for t in tensors.values()} <= {"bfloat16", "int64"}
    assert sum(t["dtype"] == "bfloat16" for t in tensors.values()) > 20
    moves = [(r["bfloat16"], r["float32"]) for r in
             ({d: m["bytes_per_rank"] for d, m in zip(("bfloat16", "float32"), pair)}
              for pair in zip(reports["bfloat16"]["redistributions"], reports["float32"]["redistributions"]))]
    # the backward's values, which check's table leaves out, are gradients and cotangents: floats
    dtypes = [tensors.get(r["input"], {"dtype": "bfloat16"})["dtype"] for r in reports["bfloat16"]["redistributions"]]
    assert len(moves) == len(reports["float32"]["redistributions"]) and sum(b for b, _ in moves) > 0
    assert all(2 * b == f if d == "bfloat16" else b == f for (b, f), d in zip(moves, dtypes)), list(zip(moves, dtypes))
    assert main(["run", str(specs["bfloat16"]), "--backward"]) == 0
    assert capsys.readouterr().out.strip().endswith("matches one device")
    if not plan:
        return
    spec = yaml.safe_load(specs["bfloat16"].read_text())
    auto = [name for name in spec["inputs"] if name.startswith("model.layers.0.") and name.endswith("_proj.weight")]
    for name in auto:
        spec["inputs"][name]["placements"] = "auto"
    spec_path, planned = tmp_path / "auto.yaml", tmp_path / "planned.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert auto and main(["plan", str(spec_path), "-o", str(planned)]) == 0
    capsys.readouterr()
    planned_spec = yaml.safe_load(planned.read_text())
    assert all(planned_spec["inputs"][name]["placements"] != "auto" for name in auto)
    assert {v["dtype"] for v in planned_spec["inputs"].values()} <= {"bfloat16", "int64"}
    assert main(["run", str(planned), "--backward"]) == 0
    assert capsys.readouterr().out.strip().endswith("matches one device")
