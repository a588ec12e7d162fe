"""``layout-prop export``: the three targets, the plan as data and its round trip, and the layouts no
target can state (torch's execution test is test_export_torch.py, skipped without torch).

- hyper-parallel: the written module runs against the shared snapshot (its package loaded without
  its platform layer, as ``audit`` loads it): ``make_mesh`` builds the snapshot's ``DeviceMesh``,
  ``SHARDING_PLAN`` is its ``ShardingPlan``, and every entry, turned into the snapshot's ``Layout``
  the way ``shard_module`` turns it (``Layout.from_device_mesh(mesh)(value)``, then
  ``placement_to_tensor_map`` for the placement form), reads back as layout-prop's layout.
- MindSpore: each node's ``in_strategy`` equals the pieces per dim of the layouts ``check --reshard
  --json`` reports it receives (the redistribution's target where one is inserted).
- The plan as data, imported back (``import --plan``, or written into the spec), gives a byte-identical
  ``check --reshard --json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from layout_prop.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SNAPSHOT = ROOT.parent / "shared" / "upstream" / "hyper-parallel"
BLOCK_PLAN = EXAMPLES / "llama_plan.yaml"

PARTIAL_SPEC = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)", "S(1)"]}
  w: {shape: [8, 6], placements: [R, "S(0)"]}
  b: {shape: [4, 6], placements: [R, "P"]}
nodes:
  - {name: y, op: matmul, inputs: [x, w]}
  - {name: z, op: add, inputs: [y, b]}
outputs: [z]
"""


def _check_json(capsys, *argv) -> str:
    capsys.readouterr()
    code = main(["check", *map(str, argv), "--reshard", "--json"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    return out


def _export(capsys, tmp_path, source, target, *extra, data="data.yaml"):
    capsys.readouterr()
    code_file, data_file = tmp_path / f"{target}.py", tmp_path / data
    code = main(["export", str(source), "--to", target, "-o", str(code_file), "--data", str(data_file),
                 *map(str, extra)])
    assert code == 0, capsys.readouterr().err
    return code_file.read_text(), data_file


# --------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("model", ["llama_block.mindir", "llama_block.onnx"])
@pytest.mark.parametrize("data", ["data.yaml", "data.json"])
def test_the_data_imported_back_gives_the_same_layouts(capsys, tmp_path, model, data):
    _, data_file = _export(capsys, tmp_path, EXAMPLES / model, "mindspore", "--plan", BLOCK_PLAN, data=data)
    written = yaml.safe_load(data_file.read_text())
    assert sorted(written) == ["inputs", "mesh", "parameters"]
    assert sorted(written["inputs"]) == ["cos", "sin", "x"] and len(written["parameters"]) == 9
    assert written["inputs"]["x"] == {"placements": ["S(0)", "S(1)", "S(1)"]}
    original = _check_json(capsys, EXAMPLES / model, "--plan", BLOCK_PLAN)
    assert _check_json(capsys, EXAMPLES / model, "--plan", data_file) == original


def test_the_data_written_into_the_spec_gives_the_same_layouts(capsys, tmp_path):
    """A spec (gen llama's, x, cos and sin named as the model's inputs): its inputs' placements replaced
    by the data's, the check is the same; the data names every input exactly once."""
    spec = EXAMPLES / "llama_block.yaml"
    _, data_file = _export(capsys, tmp_path, spec, "hyper-parallel", "--input", "x", "--input", "cos",
                           "--input", "sin")
    data = yaml.safe_load(data_file.read_text())
    doc = yaml.safe_load(spec.read_text())
    assert sorted(data["inputs"]) == ["cos", "sin", "x"]
    assert sorted([*data["inputs"], *data["parameters"]]) == sorted(doc["inputs"])
    for name, entry in doc["inputs"].items():
        entry["placements"] = data["inputs"][name]["placements"] if name in data["inputs"] \
            else data["parameters"][name]
    rewritten = tmp_path / "rewritten.yaml"
    rewritten.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert _check_json(capsys, rewritten) == _check_json(capsys, spec)


def test_an_auto_layout_is_exported_as_check_completes_it(capsys, tmp_path):
    spec = tmp_path / "auto.yaml"
    spec.write_text(PARTIAL_SPEC.replace('placements: [R, "S(0)"]', "placements: auto"))
    _, data_file = _export(capsys, tmp_path, spec, "hyper-parallel", "--input", "x")
    data = yaml.safe_load(data_file.read_text())
    report = json.loads(_check_json(capsys, spec))
    assert data["parameters"]["w"] == report["tensors"]["w"]["placements"]
    assert "auto" not in data["parameters"]["w"]


# --------------------------------------------------------------------------- hyper-parallel
@pytest.fixture(scope="module")
def checkout():
    from layout_prop.interop.hyper_parallel import load_checkout

    if not (SNAPSHOT / "hyper_parallel").is_dir():
        pytest.skip(f"the shared hyper-parallel snapshot is not at {SNAPSHOT}")
    return load_checkout(SNAPSHOT)


def _upstream_layouts(checkout, code: str) -> tuple[object, dict]:
    """Run the written module against the snapshot; every entry as the snapshot's Layout, by key."""
    import sys

    from layout_prop.interop.hyper_parallel import quiet_backend

    namespace: dict = {}
    with quiet_backend(checkout):
        exec(compile(code, "hyper_parallel_plan.py", "exec"), namespace)
        mesh = namespace["make_mesh"]("cpu")
        plan = namespace["sharding_plan"](mesh)
        assert isinstance(plan, sys.modules["hyper_parallel.core.shard.sharding_plan"].ShardingPlan)
        assert isinstance(mesh, sys.modules["hyper_parallel.core.device_mesh"].DeviceMesh)
        placement_type = sys.modules["hyper_parallel.core.placement_types"].Placement
        entries = {f"plan:{k}": v for k, v in plan.plan.items()}
        for key, value in (plan.input_plan or {}).get("input", {}).items():
            entries[f"input:{key}"] = value
        for i, value in enumerate((plan.output_plan or {}).get("output", [])):
            entries[f"output:{i}"] = value
        layouts = {}
        for key, value in entries.items():
            if isinstance(value, checkout.layout_class):  # built by the module in the alias form
                layouts[key] = (value, False)
                continue
            assert isinstance(value, tuple) and all(isinstance(p, placement_type) for p in value), key
            layouts[key] = (checkout.layout_class.from_device_mesh(mesh)(value), True)  # shard_module's _to_layout
    return mesh, layouts


def _same(checkout, ours, upstream_and_form) -> None:
    from layout_prop.interop.hyper_parallel import from_upstream

    upstream, placement_form = upstream_and_form
    if placement_form:  # what shard_module does with a parameter's placements before it is used
        upstream.placement_to_tensor_map(ours.ndim)
    assert from_upstream(upstream, ours.mesh) == ours


def test_the_hyper_parallel_module_builds_the_snapshots_plan(capsys, tmp_path, checkout):
    from layout_prop.commands.export import export_text
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    plan = load_plan(BLOCK_PLAN)
    graph = build_graph(read_model(EXAMPLES / "llama_block.mindir", plan), plan)
    export, code = export_text(graph, "hyper-parallel")
    mesh, layouts = _upstream_layouts(checkout, code)
    assert tuple(mesh.mesh_shape) == (2, 2, 2) and tuple(mesh.rank_list) == tuple(range(8))
    assert len(layouts) == 9 + 3 + 1
    for name, tensor in export.parameters.items():
        _same(checkout, tensor.own_layout(), layouts[f"plan:{name}"])
    for name, tensor in export.inputs.items():
        _same(checkout, tensor.layout, layouts[f"input:{name}"])
    # x is cut on dim 1 by sp and tp: the alias form (the placement form refuses two axes on a dim)
    assert layouts["input:x"][1] is False
    _same(checkout, next(iter(export.outputs.values())), layouts["output:0"])


def test_a_partial_parameter_and_torchs_transposed_weights_reach_hyper_parallel(tmp_path, checkout):
    from layout_prop.commands.export import export_text
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.loader import load_spec
    from layout_prop.io.plan_file import load_plan

    export, code = export_text(load_spec(PARTIAL_SPEC), "hyper-parallel", data_inputs=["x"])
    assert 'Partial("sum")' in code
    _, layouts = _upstream_layouts(checkout, code)
    _same(checkout, export.parameters["b"].layout, layouts["plan:b"])  # Partial("sum") on tp
    # the output is a partial sum too: no output_plan (hyper-parallel redistributes to no partial layout)
    assert export.outputs["z"].has_partial() and "output:0" not in layouts and "# no output_plan" in code
    # torch's Linear weight (out, in), stored (in, out) by the ONNX exporter: colwise is Shard(0) again
    plan = load_plan({"mesh": {"shape": [2], "names": ["tp"]},
                      "parameters": {"*.q_proj.weight": "colwise", "*.o_proj.weight": "rowwise"}})
    graph = build_graph(read_model(EXAMPLES / "models" / "llama.onnx", plan), plan)
    export, code = export_text(graph, "hyper-parallel")
    q = export.parameters["model.layers.0.self_attn.q_proj.weight"]
    assert q.transposed and q.layout.placement_strs() == ["S(1)"]
    assert "'model.layers.0.self_attn.q_proj.weight': (Shard(0),)" in code
    assert "'model.layers.0.self_attn.o_proj.weight': (Shard(1),)" in code
    assert "'model.embed_tokens.weight': (Replicate(),)" in code
    assert "unsqueeze_14" not in code.split("def sharding_plan")[1].split("# constants")[0]  # a constant
    _, layouts = _upstream_layouts(checkout, code)
    _same(checkout, q.own_layout(), layouts["plan:model.layers.0.self_attn.q_proj.weight"])


# --------------------------------------------------------------------------- MindSpore
def _pieces(placements, shape, mesh_shape) -> tuple[int, ...]:
    counts = [1] * len(shape)
    for axis, p in enumerate(placements):
        if p.startswith("S("):
            counts[int(p[2:-1]) % len(shape)] *= mesh_shape[axis]
    return tuple(counts)


def test_mindspore_strategies_are_the_layouts_check_reports(capsys, tmp_path):
    """Every node's in_strategy is what ``explain NODE --reshard --json`` says each operand arrives as
    (a redistribution's output where check --reshard moves it, shared moves included)."""
    model = EXAMPLES / "llama_block.mindir"
    code, _ = _export(capsys, tmp_path, model, "mindspore", "--plan", BLOCK_PLAN)
    namespace: dict = {}
    exec(compile(code, "strategies.py", "exec"), namespace)
    strategies = namespace["STRATEGIES"]
    report = json.loads(_check_json(capsys, model, "--plan", BLOCK_PLAN))
    assert main(["import", str(model), "--plan", str(BLOCK_PLAN), "-o", str(tmp_path / "spec.yaml")]) == 0
    spec = yaml.safe_load((tmp_path / "spec.yaml").read_text())
    mesh_shape = report["mesh"]["shape"]
    moved = 0
    for node in spec["nodes"]:
        capsys.readouterr()
        assert main(["explain", str(model), node["name"], "--plan", str(BLOCK_PLAN), "--reshard", "--json",
                     "--depth", "1"]) == 0
        arrived = json.loads(capsys.readouterr().out)["inputs"]
        want = []
        for value, seen in zip(node["inputs"], arrived):
            placements = seen["placements"][1:-1].split(", ")  # "(S(0), S(1), R)"
            moved += placements != report["tensors"][value]["placements"]
            want.append(_pieces(placements, report["tensors"][value]["shape"], mesh_shape))
        got = strategies[node["name"]]
        assert got["op"] == node["op"] and got["in_strategy"] == tuple(want), node["name"]
    assert len(spec["nodes"]) == len(strategies) == 25
    # operands that arrive redistributed (their strategy is the moved layout): wq, wk, wv read one gathered
    # norm output, w1 and w3 another, attention its k and v, the two residual adds a reduce-scatter
    assert moved == 9
    wq = strategies["layers.0.attention.wq"]
    assert wq["in_strategy"] == ((2, 2, 1), (2, 1)) and wq["in_layout"] == (("dp", "sp", "None"), ("tp", "None"))
    assert strategies["layers.0.attention.wo"]["out_strategy"] is None  # a partial sum on tp


# --------------------------------------------------------------------------- what a target cannot state
@pytest.mark.parametrize("target, name", [
    ("mindspore", "transformer.h.0.attn.c_attn.weight"),
    ("hyper-parallel", "transformer.h.0.attn.c_attn.weight"),
])  # torch writes it as its _StridedShard: graph_tests/test_export_strided.py runs it
def test_a_strided_shard_is_one_line_naming_the_tensor(capsys, tmp_path, target, name):
    plan = tmp_path / "gpt2.yaml"
    plan.write_text('mesh: {shape: [2], names: [tp]}\nparameters:\n  "*.c_attn.weight": colwise_fused(3)\n')
    capsys.readouterr()
    assert main(["export", str(EXAMPLES / "models" / "gpt2.onnx"), "--plan", str(plan), "--to", target]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not-expressible" in err and name in err and "_S(1,3)" in err, err


@pytest.mark.parametrize("target", ["mindspore", "torch"])
def test_a_partial_input_is_refused_where_the_target_has_none(capsys, tmp_path, target):
    spec = tmp_path / "partial.yaml"
    spec.write_text(PARTIAL_SPEC)
    capsys.readouterr()
    assert main(["export", str(spec), "--to", target, "-o", str(tmp_path / "out.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not-expressible" in err and "'b'" in err and "P(sum)" in err, err
    assert not (tmp_path / "out.py").exists()


UNFIXABLE_SPEC = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x:   {shape: [4, 4, 16, 63], placements: ["S(0)", R]}
  cos: {shape: [1, 1, 16, 63], placements: [R, R], requires_grad: false}
  sin: {shape: [1, 1, 16, 63], placements: [R, R], requires_grad: false}
nodes:
  - {name: y, op: rotary_position_embedding, inputs: [x, cos, sin], attrs: {mode: 0}}
outputs: [y]
"""


@pytest.mark.parametrize("target", ["hyper-parallel", "mindspore", "torch"])
def test_a_spec_with_a_violation_no_redistribution_fixes_is_not_exported(capsys, tmp_path, target):
    """An odd rotary head dim (63) is a violation check --reshard cannot fix: export wrote the plan anyway,
    headed 'Every layout was checked by layout-prop'; now it prints the violation and exits 1, as check does."""
    spec = tmp_path / "odd.yaml"
    spec.write_text(UNFIXABLE_SPEC)
    capsys.readouterr()
    assert main(["export", str(spec), "--to", target, "--input", "x", "-o", str(tmp_path / "out.py")]) == 1
    err = capsys.readouterr().err
    assert "violation [invalid-head-dim] y.x" in err and "nothing exported" in err, err
    assert not (tmp_path / "out.py").exists()


def test_export_refuses_an_unknown_input_and_a_model_without_plan(capsys):
    capsys.readouterr()
    assert main(["export", str(EXAMPLES / "llama_block.yaml"), "--to", "torch", "--input", "nope"]) == 2
    assert "unknown-input" in capsys.readouterr().err
    assert main(["export", str(EXAMPLES / "llama_block.mindir"), "--to", "torch"]) == 2
    assert "missing-plan" in capsys.readouterr().err


def test_export_refuses_an_input_named_twice(capsys, tmp_path):
    """'--input x --input x' was taken silently: a name given twice is one line, exit 2, nothing written (as a
    value listed twice in a spec's outputs, or an axis twice in plan --search --axes)."""
    out = tmp_path / "out.py"
    capsys.readouterr()
    argv = ["export", str(EXAMPLES / "llama_block.yaml"), "--to", "hyper-parallel", "-o", str(out)]
    assert main(argv + ["--input", "x", "--input", "cos", "--input", "x"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and not out.exists()
    assert lines == ["layout-prop: error: duplicate-input at --input: 'x' is given twice "
                     "(hint: name each model input once)"], lines
    assert main(argv + ["--input", "x", "--input", "cos"]) == 0, capsys.readouterr().err


MLP_SPEC = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [8, 16], placements: ["S(0)", R]}
  fc1.weight: {shape: [32, 16], placements: [R, "S(0)"]}
  fc2.weight: {shape: [16, 32], placements: [R, "S(1)"]}
nodes:
  - {name: fc1, op: linear, inputs: [x, fc1.weight]}
  - {name: fc2, op: linear, inputs: [fc1, fc2.weight]}
outputs: [fc2]
"""


@pytest.mark.parametrize("target", ["hyper-parallel", "mindspore", "torch"])
def test_a_spec_exported_without_input_says_which_inputs_it_took_as_what(capsys, tmp_path, target):
    """A spec does not say which inputs are activations: without --input, export tells them from the
    parameters (x, cut on dp on its dim 0, is a batch) and says so in one note naming each kind and how
    to correct it; with --input, and for a model (whose inputs are its own), no note."""
    spec = tmp_path / "mlp.yaml"
    spec.write_text(MLP_SPEC)
    capsys.readouterr()
    assert main(["export", str(spec), "--to", target]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("note:")] == [
        "note: no --input given: export took as model inputs: x (dim 0 cut on dp: a batch); as parameters "
        "(weights to shard): fc1.weight, fc2.weight; if that is wrong, name every model input (activations, "
        "token ids) with --input NAME"], err
    assert "note:" not in out
    assert main(["export", str(spec), "--to", target, "--input", "x"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert main(["export", str(EXAMPLES / "llama_block.mindir"), "--plan", str(BLOCK_PLAN), "--to", target]) == 0
    assert "note:" not in capsys.readouterr().err


def test_the_note_names_eight_inputs_and_counts_the_rest(capsys):
    """gen llama's x (cut on dp) is an input, cos and sin (no gradient) buffers, the weights parameters."""
    capsys.readouterr()
    assert main(["export", str(EXAMPLES / "llama_block.yaml"), "--to", "torch"]) == 0
    assert ("took as model inputs: x (dim 0 cut on dp: a batch); as buffers (no gradient): cos, sin; as parameters "
            "(weights to shard): model.layers.0.input_layernorm.weight, model.layers.0.self_attn.q_proj.weight, "
            "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight, "
            "model.layers.0.self_attn.o_proj.weight, model.layers.0.post_attention_layernorm.weight, "
            "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight, ... (9 in all); "
            "if that is wrong") in capsys.readouterr().err


def test_integer_inputs_are_data_whatever_input_names(capsys, tmp_path):
    """Token ids and labels take no gradient: they are model inputs even when --input names others."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.io.loader import format_spec

    spec = tmp_path / "llama.yaml"
    spec.write_text(format_spec(llama_spec(full=True), None))
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "torch", "--input", "cos"]) == 0
    out = capsys.readouterr().out
    inputs = out[out.index("INPUT_PLACEMENTS = {"):].split("}")[0]
    assert "'tokens'" in inputs and "'labels'" in inputs and "'cos'" in inputs and "'sin'" not in inputs
    buffers = out[out.index("BUFFER_PLACEMENTS = {"):].split("}")[0]
    assert "'sin'" in buffers and "'model.embed_tokens.weight'" not in buffers


def test_a_parameter_no_target_places_hints_at_input_when_none_was_named(capsys, tmp_path):
    """An x replicated on dp (no batch to tell it by) cut by sp and tp on one dim: taken as a parameter,
    hyper-parallel cannot place it. Without --input the one-line error says x may be an input."""
    spec = tmp_path / "block.yaml"
    text = (EXAMPLES / "llama_block.yaml").read_text()
    spec.write_text(text.replace("placements: [S(0), S(1), S(1)]", "placements: [R, S(1), S(1)]", 1))
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "hyper-parallel"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not-expressible" in err and "parameter 'x'" in err, err
    assert "name it with --input NAME: without --input a spec's input that takes a gradient is a parameter" in err
    assert main(["export", str(spec), "--to", "hyper-parallel", "--input", "x"]) == 0


# --------------------------------------------------------------------------- the model's own parameter names
def test_deduplicated_parameters_are_exported_under_every_name(capsys, tmp_path):
    """The dynamo exporter keeps one tensor for the five equal RMSNorm weights of the Llama fixture: every
    one of the model's parameters is in the export, and the data, imported back, checks the same."""
    plan = tmp_path / "plan.yaml"
    plan.write_text('mesh: {shape: [2], names: [tp]}\nparameters:\n  "*.self_attn.[qkv]_proj.weight": colwise\n'
                    '  "*.self_attn.o_proj.weight": rowwise\n  "*": R\n')
    model = EXAMPLES / "models" / "llama.onnx"
    code, data_file = _export(capsys, tmp_path, model, "torch", "--plan", plan)
    norms = ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
             "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
             "model.norm.weight"]
    for name in norms:
        assert f"'{name}': (Replicate(),)" in code
    assert "'model.layers.1.self_attn.q_proj.weight': (Shard(0),)" in code
    assert "unsqueeze_14" not in code  # a constant (the folded rotary table), no parameter of the model
    data = yaml.safe_load(data_file.read_text())
    assert all(data["parameters"][n] == ["R"] for n in norms) and "unsqueeze_14" not in data["parameters"]
    assert _check_json(capsys, model, "--plan", data_file) == _check_json(capsys, model, "--plan", plan)


def test_a_tied_copy_exports_with_its_parameter_or_is_refused(capsys, tmp_path):
    """GPT-2's lm_head is the embedding table read transposed (the importer names the copy lm_head.weight.T):
    torch has one parameter, so the copy must carry the same layout transposed."""
    model = EXAMPLES / "models" / "gpt2.onnx"
    plan = tmp_path / "plan.yaml"
    plan.write_text('mesh: {shape: [2], names: [tp]}\nparameters:\n  "lm_head.weight": vocab\n'
                    '  "lm_head.weight.T": colwise\n  "*": R\n')
    code, data_file = _export(capsys, tmp_path, model, "torch", "--plan", plan)
    assert "'lm_head.weight': (Shard(0),)" in code and "lm_head.weight.T" not in code
    assert _check_json(capsys, model, "--plan", data_file) == _check_json(capsys, model, "--plan", plan)
    plan.write_text('mesh: {shape: [2], names: [tp]}\nparameters:\n  "lm_head.weight": vocab\n  "*": R\n')
    capsys.readouterr()
    assert main(["export", str(model), "--plan", str(plan), "--to", "hyper-parallel"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not-expressible" in err and "'lm_head.weight.T'" in err and "tied" in err and err.count("\n") == 0


@pytest.mark.parametrize("flag", ["-o", "--data"])
def test_a_bad_output_is_refused_before_the_model_is_read(capsys, tmp_path, flag):
    (tmp_path / "folder.py").mkdir()
    capsys.readouterr()
    argv = ["export", str(tmp_path / "missing.onnx"), "--plan", str(tmp_path / "missing.yaml"), "--to", "torch",
            flag, str(tmp_path / "folder.py")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "write-failed" in err and "folder" in err, err


PLANNED_SPEC = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [4, 8], placements: ["S(0)", "S(1)"]}
  w: {shape: [8, 6], placements: [R, "S(1)"]}
nodes:
  - {name: x_moved, op: redistribute, inputs: [x], attrs: {placements: ["S(0)", R]}}
  - {name: y, op: matmul, inputs: [x_moved, w]}
  - {name: z, op: relu, inputs: [y]}
outputs: [z]
"""


def test_plans_output_exports_and_its_moves_are_no_strategies(capsys, tmp_path):
    """A spec with an explicit redistribute node (as plan -o writes one): the consumer's strategy is the
    moved layout, the move itself is MindSpore's to insert."""
    spec = tmp_path / "planned.yaml"
    spec.write_text(PLANNED_SPEC)
    code, _ = _export(capsys, tmp_path, spec, "mindspore", "--input", "x")
    namespace: dict = {}
    exec(compile(code, "strategies.py", "exec"), namespace)
    strategies = namespace["STRATEGIES"]
    assert sorted(strategies) == ["y", "z"]
    assert strategies["y"]["in_strategy"] == ((2, 1), (1, 2))  # x moved to (S(0), R); w (R, S(1))
    assert strategies["z"]["in_strategy"] == ((2, 2),)


def test_a_partial_sum_arriving_at_a_node_is_left_to_mindspore(capsys, tmp_path):
    """PARTIAL_SPEC's add receives the product's partial sum (check --reshard leaves it so). It was refused;
    MindSpore's semi-auto parallel reduces a MatMul's partial output itself, so the add's strategy lists it
    reduced (R on tp) and partial_in names it."""
    spec = tmp_path / "partial.yaml"
    spec.write_text(PARTIAL_SPEC.replace('b: {shape: [4, 6], placements: [R, "P"]}', "b: {shape: [4, 6]}"))
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "mindspore", "--input", "x"]) == 0
    ns: dict = {}
    exec(capsys.readouterr().out, ns)
    z = ns["STRATEGIES"]["z"]
    assert z["primitive"] == "Add" and z["partial_in"] == ("y",) and z["in_strategy"] == ((2, 1), (1, 1)), z
    assert ns["STRATEGIES"]["y"]["primitive"] == "MatMul" and ns["STRATEGIES"]["y"]["out_strategy"] is None


def test_names_yaml_reads_as_no_string_are_quoted_in_the_data(capsys, tmp_path):
    """A parameter named ``null``, ``true``, ``123`` or ``1e3`` is written quoted: unquoted, YAML reads
    it as None, True or a number and import --plan would look for a parameter named 'None' or '1000.0'."""
    from layout_prop.io.plan_file import load_plan

    names = ["null", "true", "123", "1e3", "w[0]"]
    spec = tmp_path / "odd.yaml"
    spec.write_text("mesh: {shape: [2], names: [tp]}\ninputs:\n  x: {shape: [4, 8]}\n"
                    + "".join(f'  "{n}": {{shape: [8], placements: ["S(0)"]}}\n' for n in names)
                    + "nodes:\n" + "".join(f'  - {{name: y{i}, op: add, inputs: [x, "{n}"]}}\n'
                                           for i, n in enumerate(names))
                    + f"outputs: [{', '.join(f'y{i}' for i in range(len(names)))}]\n")
    _, data_file = _export(capsys, tmp_path, spec, "hyper-parallel", "--input", "x")
    rules = load_plan(data_file).parameters
    assert [r.pattern for r in rules] == ["null", "true", "123", "1e3", "w[[]0]"]
    assert all(r.placements == ("S(0)",) for r in rules)


def test_mindspores_parameter_layouts_leave_out_constants(capsys, tmp_path):
    """The folded rotary tables of the Llama fixture are constants, no parameters of the model: MindSpore's
    PARAMETER_LAYOUTS (for Cell.shard's parameter_plan) names the model's parameters only, as the other
    targets do; every de-duplicated RMSNorm weight is there under its own name."""
    plan = tmp_path / "plan.yaml"
    plan.write_text('mesh: {shape: [2], names: [tp]}\nparameters:\n  "*": R\n')
    code, _ = _export(capsys, tmp_path, EXAMPLES / "models" / "llama.onnx", "mindspore", "--plan", plan)
    namespace: dict = {}
    exec(code, namespace)
    names = set(namespace["PARAMETER_LAYOUTS"])
    assert "unsqueeze_14" not in names and "unsqueeze_15" not in names
    assert {"model.norm.weight", "model.layers.1.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight"} <= names


def test_torch_styles_are_not_used_where_layout_prop_gathers_on_their_axis(capsys, tmp_path):
    """A softmax over a colwise Linear's output: layout-prop moves the output on tp (an all-to-all), which
    ColwiseParallel (its output a local shard) would not do, so the softmax would run over half the columns.
    The export places every parameter as a DTensor instead; without the softmax the style is used."""
    spec = tmp_path / "softmax.yaml"
    body = ('mesh: {shape: [2, 2], names: [dp, tp]}\ninputs:\n  x: {shape: [8, 16], placements: ["S(0)", R]}\n'
            '  fc1.weight: {shape: [32, 16], placements: [R, "S(0)"]}\nnodes:\n'
            '  - {name: fc1, op: linear, inputs: [x, fc1.weight]}\n')
    spec.write_text(body + "  - {name: sm, op: softmax, inputs: [fc1], attrs: {axis: -1}}\noutputs: [sm]\n")
    code, _ = _export(capsys, tmp_path, spec, "torch", "--input", "x")
    assert "TP_AXIS = None" in code and "ColwiseParallel()," not in code
    assert "'fc1.weight': (Replicate(), Shard(0))," in code
    spec.write_text(body + "outputs: [fc1]\n")
    code, _ = _export(capsys, tmp_path, spec, "torch", "--input", "x")
    assert "TP_AXIS = 'tp'" in code and "'fc1': ColwiseParallel()," in code


def test_the_parameter_counts_said_are_the_parameters_written(capsys, tmp_path):
    """The Llama fixture: 19 weight inputs in the graph, 2 of them constants (the rotary tables), and 4 more
    names of the de-duplicated RMSNorm weight: 21 parameters are written, and the "wrote" line and the
    data's header comment count those (they said 19, constants in and aliases out)."""
    import re

    plan = tmp_path / "plan.yaml"
    plan.write_text('mesh: {shape: [2], names: [tp]}\nparameters:\n  "*": R\n')
    code, data_file = _export(capsys, tmp_path, EXAMPLES / "models" / "llama.onnx", "torch", "--plan", plan)
    err = capsys.readouterr().err
    block = code.split("PARAMETER_PLACEMENTS = {\n")[1].split("\n}")[0]
    written = len(re.findall(r"^    '[^']+': \(", block, re.M))
    data = yaml.safe_load(data_file.read_text())
    assert written == len(data["parameters"]) == 21
    assert f"(torch: {written} parameter(s), 1 input(s))" in err
    assert data_file.read_text().startswith(f"# layout-prop export: 1 input(s), {written} parameter(s);")


def test_mesh_names_yaml_reads_as_no_string_are_quoted_in_the_data(capsys, tmp_path):
    """A mesh axis named ``off`` or ``null``: written bare, YAML reads False or None and import --plan refuses
    the data it was told it could read (bad-type at mesh.names)."""
    from layout_prop.io.plan_file import load_plan

    spec = tmp_path / "mesh.yaml"
    spec.write_text('mesh: {shape: [2, 2], names: ["off", "null"]}\ninputs:\n  x: {shape: [4, 8], '
                    'placements: ["S(0)", "S(1)"]}\nnodes:\n  - {name: y, op: relu, inputs: [x]}\noutputs: [y]\n')
    _, data_file = _export(capsys, tmp_path, spec, "torch", "--input", "x")
    assert load_plan(data_file).mesh.names == ("off", "null")
    assert "shape: [2, 2]" in data_file.read_text()  # the sizes stay numbers


@pytest.mark.parametrize("target", ["hyper-parallel", "mindspore", "torch"])
def test_a_spec_file_name_with_quotes_still_gives_python(capsys, tmp_path, target):
    """The spec's file name is written into the module's docstring: 'q\"\"\"x\\.yaml' ended it early and the
    module did not parse."""
    import ast

    spec = tmp_path / 'q"""x\\.yaml'
    spec.write_text('mesh: {shape: [2], names: [tp]}\ninputs:\n  x: {shape: [4, 8], placements: ["S(0)"]}\n'
                    '  w: {shape: [8, 6], placements: [R]}\nnodes:\n  - {name: y, op: matmul, inputs: [x, w]}\n'
                    'outputs: [y]\n')
    code, _ = _export(capsys, tmp_path, spec, target, "--input", "x")
    ast.parse(code)
    assert "from q???x?.yaml." in code


def test_a_specs_own_parameter_named_dot_t_is_exported(capsys, tmp_path):
    """Only the importer names a tied copy NAME.T: a spec's parameters w and w.T are two parameters, and
    both are exported (w.T was left out as w's copy)."""
    spec = tmp_path / "tt.yaml"
    spec.write_text('mesh: {shape: [2], names: [tp]}\ninputs:\n  x: {shape: [4, 8]}\n'
                    '  w: {shape: [8, 8], placements: [R]}\n  w.T: {shape: [8, 8], placements: [R]}\n'
                    'nodes:\n  - {name: y, op: matmul, inputs: [x, w]}\n  - {name: z, op: matmul, inputs: [y, w.T]}\n'
                    'outputs: [z]\n')
    for target in ("torch", "hyper-parallel", "mindspore"):
        code, _ = _export(capsys, tmp_path, spec, target, "--input", "x")
        assert "'w.T': " in code, target


# --------------------------------------------------------------------------- the training configuration
def _config_spec(tmp_path, block: str):
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.io.loader import format_spec

    spec = tmp_path / "llama.yaml"
    spec.write_text(format_spec(llama_spec(full=True, mesh=(("dp", 2), ("sp", 1), ("tp", 2))), None) + block)
    return spec


@pytest.mark.parametrize("target, schedule", [("hyper-parallel", "gpipe"), ("mindspore", "interleaved")])
def test_a_pipeline_is_refused_in_one_line_never_dropped(capsys, tmp_path, target, schedule):
    """export showed the graph without the spec's pipeline: block and wrote every parameter replicated on pp:
    a schedule a target's export does not write is one not-expressible line naming it (MindSpore and
    hyper-parallel write 1f1b: test_export_pipeline.py builds and runs them; torch: test_export_torch*.py)."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.io.loader import format_spec

    spec = yaml.safe_load(format_spec(llama_spec(layers=4, full=True, batch=8, mesh=(("dp", 2), ("sp", 1), ("tp", 2))),
                                      None))
    spec["mesh"] = {"shape": [2, 2, 2], "names": ["pp", "dp", "tp"]}
    for entry in spec["inputs"].values():
        if "placements" in entry:  # sp (size 1) becomes pp, first: a stage holds whole values (R)
            entry["placements"] = ["R", entry["placements"][0], entry["placements"][2]]
    virtual = ", virtual_stages: 2" if schedule == "interleaved" else ""
    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False) + f"pipeline: {{axis: pp, micro_batches: 4, schedule: "
                    f"{schedule}{virtual}}}\n")
    capsys.readouterr()
    assert main(["export", str(path), "--to", target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not-expressible" in err[0] and "pipeline: block" in err[0] and schedule in err[0], err


def test_hyper_parallel_refuses_zero_beside_tensor_parallelism_and_recompute(capsys, tmp_path):
    """hyper-parallel's fully_shard is written for data parallelism only (executed in
    test_export_hyper_parallel_run.py); beside tp, and recomputation, are one line each."""
    spec = _config_spec(tmp_path, "zero: {stage: 3}\n")
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "hyper-parallel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the zero: block (ZeRO stage 3 over dp): hyper-parallel's fully_shard " \
        "beside shard_module on the other mesh axes (tp)" in err[0], err
    spec = _config_spec(tmp_path, "recompute: full\n")
    assert main(["export", str(spec), "--to", "hyper-parallel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the recompute: block (full)" in err[0], err


def test_torch_writes_zero_recompute_and_the_batch_and_drops_unit_axes(capsys, tmp_path):
    spec = _config_spec(tmp_path, "zero: {stage: 3}\nrecompute: full\ntraining: {global_batch: 8, micro_batch: 1}\n")
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "torch"]) == 0
    out = capsys.readouterr().out
    for line in ("MESH_DIM_NAMES = ('dp', 'tp')", "#: left out of the mesh (size 1: they cut nothing): sp",
                 "ZERO_STAGE = 3", "ZERO_AXES = ('dp',)", "MODEL_AXES = ('tp',)", "RECOMPUTE = 'full'",
                 "GLOBAL_BATCH = 8", "MICRO_BATCH = 1", "    'cos': (Replicate(), Replicate()),"):
        assert line in out.splitlines(), line
    assert "'cos'" not in out[out.index("PARAMETER_PLACEMENTS"):out.index("BUFFER_PLACEMENTS")]
    compile(out, "plan.py", "exec")
    spec = _config_spec(tmp_path, "zero: {stage: 1}\n")
    assert main(["export", str(spec), "--to", "torch"]) == 0
    out = capsys.readouterr().out
    assert "ZERO_STAGE = 1" in out and "this writes ZeRO-2 (gradients too)" in out
    spec = _config_spec(tmp_path, "recompute: selective\n")
    assert main(["export", str(spec), "--to", "torch"]) == 2
    assert "cannot write recompute: selective" in capsys.readouterr().err


def test_a_vocabulary_parallel_embedding_is_refused_for_hyper_parallel():
    """The snapshot's embedding over a row-cut table does not mask ids outside a rank's rows: refused."""
    from layout_prop.commands.export import export_text
    from layout_prop.core.errors import LayoutPropError
    from layout_prop.io.loader import load_spec
    from layout_prop.frontends.generate import llama_spec

    with pytest.raises(LayoutPropError) as err:
        export_text(load_spec(llama_spec(full=True)), "hyper-parallel")
    assert err.value.code == "not-expressible" and "'model.embed_tokens.weight'" in err.value.message
    assert "does not mask the ids" in err.value.message


def test_mindspore_builds_every_layout_strategy_and_setting_on_cpu(capsys, tmp_path):
    """The exported MindSpore module, executed with MindSpore on CPU: every node's Layouts, every parameter's
    Layout, every primitive with its shard strategy, AutoParallel with the ZeRO as hsdp, recompute. (Its
    semi-auto parallel compile needs Ascend or GPU: not executed here.) gen llama's default spec was refused
    over the partial sum of the residual add; it exports, and so does the vocabulary-parallel training graph
    with ZeRO-3 and recomputation."""
    pytest.importorskip("mindspore", reason="MindSpore is optional: pip install -e '.[mindspore]'")
    from mindspore import nn

    from layout_prop.frontends.generate import llama_spec
    from layout_prop.io.loader import format_spec

    specs = {"llama.yaml": format_spec(llama_spec(), None),
             "full.yaml": format_spec(llama_spec(full=True), None) + "zero: {stage: 3}\nrecompute: full\n"}
    for name, text in specs.items():
        (tmp_path / name).write_text(text)
        capsys.readouterr()
        assert main(["export", str(tmp_path / name), "--to", "mindspore"]) == 0, capsys.readouterr().err
        ns: dict = {}
        exec(compile(capsys.readouterr().out, name, "exec"), ns)
        built = [ns["shard_primitive"](node) for node in ns["STRATEGIES"]]
        for node in ns["STRATEGIES"]:
            assert len(ns["in_layouts"](node)) == len(ns["STRATEGIES"][node]["in_strategy"])
        assert sum(p is not None for p in built) >= 15
        assert all(p.attrs.get("in_strategy") or p.attrs.get("in_layout") for p in built if p is not None), \
            [p.attrs for p in built if p is not None][:3]
        assert len(ns["parameter_layouts"]()) == len(ns["PARAMETER_LAYOUTS"]) > 5
        if name == "full.yaml":
            assert ns["ZERO_STAGE"] == 3 and ns["ZERO_SHARD_SIZE"] == 2 and ns["RECOMPUTE"] == "full"
            assert ns["STRATEGIES"]["l0_res1"]["partial_in"] == ("embedded", "l0_attn_out")
            assert type(ns["auto_parallel"](nn.Dense(4, 4))).__name__ == "AutoParallel"
            cell = nn.Dense(4, 4)
            ns["recompute_cells"]({"l0": cell})
