"""plan --search on imported models (issue #31, item 4): the torch-exported fixtures of examples/models/
recognised with the sizes their Hugging Face configs give, priced as the ``gen`` model of those sizes (the
same ranking as the gen spec itself), what the generator leaves out named in one note, non-decoder models
refused in one line, and the sharding plan --plan-out writes in the model's own names read back by import."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("onnx")

from layout_prop.cli import main  # noqa: E402
from layout_prop.workflows.search import load_model_shape, run_search  # noqa: E402
from layout_prop.frontends import load_model  # noqa: E402
from layout_prop.frontends.generate import gpt_spec, llama_spec  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.perf.clusters import get_cluster  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "examples" / "models"
ONE_RANK = {"mesh": {"shape": [1], "names": ["tp"]}}
DECODERS = ["llama", "qwen2", "mistral", "gemma", "phi3", "gpt2"]


def fixture_configs() -> tuple[dict[str, dict], int]:
    """The keyword arguments of every fixture's Hugging Face config, read from make_fixtures.py's source (the
    script needs torch and transformers to run; its configs are literals), and its sequence length."""
    tree = ast.parse((MODELS / "make_fixtures.py").read_text())
    consts = {n.targets[0].id: n.value.value for n in tree.body
              if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "configs")
    env: dict[str, dict] = {}

    def value(node):
        if isinstance(node, ast.Name):
            return env[node.id] if node.id in env else consts[node.id]
        if isinstance(node, ast.Call):  # dict(common, ...)
            return call_kwargs(node)
        return ast.literal_eval(node)

    def call_kwargs(call: ast.Call) -> dict:
        out: dict = {}
        for arg in call.args:  # dict(common, ...)
            out.update(value(arg))
        for kw in call.keywords:
            out.update(value(kw.value) if kw.arg is None else {kw.arg: value(kw.value)})
        return out

    configs = {}
    for stmt in func.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            env[stmt.targets[0].id] = call_kwargs(stmt.value)
        if isinstance(stmt, ast.Return):
            for entry in stmt.value.elts:
                configs[entry.elts[0].value] = call_kwargs(entry.elts[2])
    return configs, consts["SEQ"]


def expected_sizes(name: str) -> dict:
    """The sizes the search should read off the fixture, from its config (Hugging Face's names)."""
    configs, seq = fixture_configs()
    c = configs[name]
    if name == "gpt2":  # GPT2Config: n_inner None is 4 x n_embd
        return dict(layers=c["n_layer"], hidden=c["n_embd"], heads=c["n_head"], kv_heads=None, ffn=4 * c["n_embd"],
                    vocab=c["vocab_size"], seq=seq)
    return dict(layers=c["num_hidden_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"],
                kv_heads=c["num_key_value_heads"], ffn=c["intermediate_size"], vocab=c["vocab_size"], seq=seq)


def imported_shape(name: str):
    return load_model_shape(load_model(str(MODELS / f"{name}.onnx"), ONE_RANK))


def one_line_error(capsys, argv, code):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and code in err, err
    return err


@pytest.mark.parametrize("name", DECODERS)
def test_a_torch_exported_decoder_is_recognised_with_its_configs_sizes(name):
    want = expected_sizes(name)
    reference = np.load(MODELS / f"{name}.npz")  # what torch computed: (batch, seq) ids in, (.., vocab) logits out
    assert reference["input_ids"].shape[1] == want["seq"] and reference["logits"].shape[-1] == want["vocab"]
    model = imported_shape(name)
    got = dict(layers=model.layers, hidden=model.hidden, heads=model.heads, kv_heads=model.kv_heads, ffn=model.ffn,
               vocab=model.vocab, seq=model.seq)
    assert got == want
    assert model.family == ("gpt" if name == "gpt2" else "llama") and model.dtype == "float32"
    assert model.full and model.distinct_layers == 1
    assert model.tie == (name in ("gemma", "gpt2"))  # Gemma and GPT-2 tie the head to the embedding


#: what each fixture has that the generator of its family does not write (the one note names them)
DIFFERENCES = {"llama": [], "mistral": [], "qwen2": ["biases on k, q, v"],
               "gemma": ["gated MLP activation gelu", "norm weights that are constants", "scaled embeddings"],
               "phi3": ["fused qkv_proj", "fused gate_up_proj"],
               "gpt2": ["no dropout"]}  # gen gpt fuses q, k, v into c_attn as GPT-2 does


@pytest.mark.parametrize("name", DECODERS)
def test_one_note_names_what_the_generator_leaves_out(name, capsys):
    argv = ["plan", str(MODELS / f"{name}.onnx"), "--search", "--cluster", "a100-80g", "--devices", "4",
            "--global-batch", "8", "--axes", "pp=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: imported")]
    assert len(notes) == 1, out
    family = "gpt" if name == "gpt2" else "llama"
    assert f"priced as a gen {family} of the same sizes" in notes[0]
    for words in DIFFERENCES[name] + ["loss"]:
        assert words in notes[0], (words, notes[0])
    if not DIFFERENCES[name]:
        assert "bias" not in notes[0] and "fused" not in notes[0] and "activation" not in notes[0]
    if name == "gpt2":  # GPT-2's fused c_attn is what gen gpt writes
        assert "fused" not in notes[0]
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["imported"]["priced_as"] == f"gen {family}"
    assert all(any(words in d for d in report["imported"]["differences"]) for words in DIFFERENCES[name])
    assert notes[0][len("note: "):] in report["notes"]


def test_the_llama_import_is_searched_as_the_gen_llama_of_its_sizes():
    """The search on the import and on ``gen llama --full`` written with the fixture's sizes: the same candidates,
    the same first and the same predicted step times (the import is priced with the generator's graph)."""
    want = expected_sizes("llama")
    spec = llama_spec(layers=want["layers"], mesh=(("dp", 1), ("sp", 1), ("tp", 1)), batch=1, seq=want["seq"],
                      hidden=want["hidden"], heads=want["heads"], ffn=want["ffn"], kv_heads=want["kv_heads"],
                      full=True, vocab=want["vocab"], tie_embeddings=False)
    gen = load_model_shape(load_spec(spec))
    imported = imported_shape("llama")
    assert imported == gen  # every size the search reads (the import's own notes are not compared)
    cluster = get_cluster("a100-80g")
    a = run_search(imported, cluster, 8, 16)
    b = run_search(gen, cluster, 8, 16)
    assert a.candidates == b.candidates > 100 and len(a.ranked) == len(b.ranked)
    assert [c.config for c in a.ranked[:10]] == [c.config for c in b.ranked[:10]]
    assert [c.step_time_s for c in a.ranked] == [c.step_time_s for c in b.ranked]
    assert a.ranked[0].step_time_s < a.ranked[-1].step_time_s  # ranked, not all equal
    assert any(n.startswith("imported Llama-family") for n in a.notes)
    assert not any(n.startswith("imported") for n in b.notes)


def test_the_gpt2_import_is_searched_as_the_gen_gpt_of_its_sizes():
    want = expected_sizes("gpt2")
    spec = gpt_spec(layers=want["layers"], mesh=(("dp", 1), ("sp", 1), ("tp", 1)), batch=1, seq=want["seq"],
                    hidden=want["hidden"], heads=want["heads"], ffn=want["ffn"], vocab=want["vocab"])
    gen, imported = load_model_shape(load_spec(spec)), imported_shape("gpt2")
    assert imported == gen
    cluster = get_cluster("a100-80g")
    a, b = run_search(imported, cluster, 4, 8), run_search(gen, cluster, 4, 8)
    assert [(c.config, c.step_time_s) for c in a.ranked] == [(c.config, c.step_time_s) for c in b.ranked]


@pytest.mark.parametrize("name, words", [
    ("bert", ["unknown-model", "encoder.layer.N", "not causal", "q, k, v projections"]),
    ("t5_torchscript", ["unknown-model", "not causal", "q, k, v projections"]),
    ("bert_torchscript", ["unknown-model", "not causal"]),
])
def test_a_model_that_is_not_a_decoder_is_one_line(name, words, capsys):
    err = one_line_error(capsys, ["plan", str(MODELS / f"{name}.onnx"), "--search", "--cluster", "a100-80g",
                                  "--devices", "8", "--global-batch", "16"], "unknown-model")
    for w in words:
        assert w in err, (w, err)
    assert "hint: plan --search takes decoder-only imports" in err


def test_an_import_with_no_layer_names_says_what_is_missing(capsys):
    err = one_line_error(capsys, ["plan", str(MODELS / "moe.onnx"), "--search", "--cluster", "a100-80g",
                                  "--devices", "8", "--global-batch", "16"], "unknown-model")
    assert "no parameter is named with a layer number" in err


def test_the_search_takes_the_model_with_or_without_a_plan(tmp_path, capsys):
    model = str(MODELS / "llama.onnx")
    common = ["--search", "--cluster", "a100-80g", "--devices", "4", "--global-batch", "8", "--json"]
    assert main(["plan", model] + common) == 0
    without = json.loads(capsys.readouterr().out)
    plan = tmp_path / "p.yaml"
    plan.write_text(yaml.safe_dump({"mesh": {"shape": [2], "names": ["tp"]},
                                    "parameters": {"*.q_proj.weight": "colwise", "*": "R"}}))
    assert main(["plan", model, "--plan", str(plan)] + common) == 0
    with_plan = json.loads(capsys.readouterr().out)
    assert without["top"] == with_plan["top"] and without["imported"] == with_plan["imported"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3", "gpt2"])
def test_plan_out_is_a_plan_in_the_models_names_that_imports_and_checks(name, tmp_path, capsys):
    """tp=2 fixed so that the plan shards: Megatron's presets by role, read back by import and check --reshard
    clean; the weights' placements are what the roles say (column-parallel: output features on tp)."""
    model = str(MODELS / f"{name}.onnx")
    out, spec = tmp_path / "plan.yaml", tmp_path / "gen.yaml"
    assert main(["plan", model, "--search", "--cluster", "a100-80g", "--devices", "8", "--global-batch", "16",
                 "--axes", "tp=2,pp=2", "--plan-out", str(out), "-o", str(spec)]) == 0
    text = capsys.readouterr().out
    assert "-o wrote the gen" in text and "not the imported model" in text
    plan = yaml.safe_load(out.read_text())
    assert plan["mesh"]["names"][-1] == "tp" and plan["mesh"]["shape"][-1] == 2
    assert "pp" in plan["mesh"]["names"] and "pp axis (2 stages) is replicated" in out.read_text()
    assert main(["import", model, "--plan", str(out), "-o", str(tmp_path / "imported.yaml")]) == 0
    capsys.readouterr()
    assert main(["check", model, "--plan", str(out), "--reshard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["violations"] == []
    tensors = report["tensors"]
    tp = plan["mesh"]["names"].index("tp")
    stem = "transformer.h.1." if name == "gpt2" else "model.layers.1."
    want = {"llama": {"self_attn.q_proj.weight": "S(1)", "self_attn.o_proj.weight": "S(0)",
                      "mlp.down_proj.weight": "S(0)", "mlp.up_proj.weight": "S(1)"},
            "qwen2": {"self_attn.k_proj.weight": "S(1)", "self_attn.o_proj.weight": "S(0)"},
            "phi3": {"self_attn.qkv_proj.weight": "_S(1,3)", "mlp.gate_up_proj.weight": "_S(1,2)",
                     "mlp.down_proj.weight": "S(0)"},
            "gpt2": {"attn.c_attn.weight": "_S(1,3)", "attn.c_proj.weight": "S(0)", "mlp.c_fc.weight": "S(1)",
                     "mlp.c_proj.weight": "S(0)"}}[name]
    for weight, placement in want.items():
        assert tensors[stem + weight]["placements"][tp] == placement, weight
    if name == "qwen2":  # the biases, one tensor shared by k and v as exported, cut as their outputs
        assert tensors["model.layers.0.self_attn.k_proj.bias"]["placements"][tp] == "S(0)"


def test_the_plan_out_of_the_llama_import_runs_equal_to_one_device(tmp_path, capsys):
    """The plan --plan-out wrote, on the model's own weights: the sharded forward and backward, assembled from the
    ranks, equal one device's."""
    model = str(MODELS / "llama.onnx")
    out = tmp_path / "plan.yaml"
    assert main(["plan", model, "--search", "--cluster", "a100-80g", "--devices", "4", "--global-batch", "8",
                 "--axes", "tp=2,dp=2", "--plan-out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", model, "--plan", str(out), "--backward", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["ok"] and run["grads"]


def renamed(spec: dict, stem: str) -> dict:
    """``spec`` as an exporter names a graph: gen already names its parameters as torch does
    (``model.layers.3.self_attn.q_proj.weight``), and its nodes ``l3_q`` are renamed after their layer's module
    (``model.layers.3.q``), so the graph is not laid out as gen writes it and is read as an import."""
    def new(name: str) -> str:
        head, colon, index = name.partition(":")
        number, _, rest = head.partition("_")
        if number[:1] == "l" and number[1:].isdigit() and rest:
            return f"{stem}.{number[1:]}.{rest}" + colon + index
        return name

    spec = json.loads(json.dumps(spec))
    for node in spec["nodes"]:
        node["name"] = new(node["name"])
        node["inputs"] = [new(i) for i in node["inputs"]]
    spec["outputs"] = [new(o) for o in spec["outputs"]]
    return spec


SIZES = dict(layers=3, seq=12, hidden=96, heads=6, ffn=160, vocab=200)


def test_torch_names_on_a_graph_of_other_sizes_read_those_sizes():
    """Sizes that differ from one another (hidden 96 = 6 heads x 16, 2 kv heads, ffn 160, vocab 200, 3 layers,
    seq 12), on ``linear`` weights (out, in) rather than the fixtures' MatMul (in, out): the model read as an
    import equals the gen spec's own, and the generator leaves nothing out (it has the loss)."""
    mesh = (("dp", 1), ("sp", 1), ("tp", 1))
    spec = llama_spec(mesh=mesh, batch=2, kv_heads=2, full=True, tie_embeddings=False, **SIZES)
    gen = load_model_shape(load_spec(spec))
    imported = load_model_shape(load_spec(renamed(spec, "model.layers")))
    assert imported.imported is not None and gen.imported is None
    assert (imported.layers, imported.hidden, imported.heads, imported.kv_heads, imported.ffn, imported.vocab,
            imported.seq, imported.tie) == (3, 96, 6, 2, 160, 200, 12, False)
    assert imported == gen and imported.imported.differences == ()
    gpt = gpt_spec(mesh=mesh, batch=2, **SIZES)
    gen = load_model_shape(load_spec(gpt))
    imported = load_model_shape(load_spec(renamed(gpt, "transformer.h")))
    assert (imported.family, imported.layers, imported.hidden, imported.heads, imported.ffn, imported.tie) == (
        "gpt", 3, 96, 6, 160, True)
    assert imported == gen and imported.imported.differences == ()  # biases on q, v, o, fc, down and dropout: gen's


def test_a_mixture_of_experts_with_torchs_names_is_refused_not_priced_as_dense():
    """Expert projections under ``mlp.experts`` (transformers 5's ``gate_up_proj``, ``down_proj``) in a graph read as an
    import must not be priced as one dense MLP."""
    from layout_prop.core.errors import SpecError
    from layout_prop.frontends.generate import moe_spec

    spec = moe_spec(layers=2, mesh=(("dp", 1), ("ep", 1), ("tp", 1)), full=True, experts=4, top_k=2)
    graph = load_spec(renamed(spec, "model.layers"))
    with pytest.raises(SpecError) as err:
        load_model_shape(graph)
    assert err.value.code == "unknown-model" and "Mixture-of-Experts" in str(err.value)
    assert "model.layers.0.mlp.experts.down_proj" in str(err.value)


def test_a_model_with_dynamic_dims_asks_for_a_plan_giving_the_shapes(tmp_path, capsys):
    import onnx

    model = onnx.load(str(MODELS / "llama.onnx"))
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.ClearField("dim_value")
    dim.dim_param = "batch"
    path = tmp_path / "dynamic.onnx"
    onnx.save(model, str(path))
    argv = ["plan", str(path), "--search", "--cluster", "a100-80g", "--devices", "4", "--global-batch", "8"]
    err = one_line_error(capsys, argv, "dynamic-shape")
    assert "give plan --search a --plan PLAN with the inputs' shapes" in err
    plan = tmp_path / "shapes.yaml"
    plan.write_text(yaml.safe_dump({"mesh": {"shape": [1], "names": ["dp"]},
                                    "inputs": {"input_ids": {"shape": [1, 8], "placements": ["R"]}}}))
    assert main(argv + ["--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["imported"]["architecture"] == "Llama-family"
