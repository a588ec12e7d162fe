"""The Llama block: Megatron TP + SP collectives found by reshard, numerics forward and backward,
and a 32-layer generated graph end to end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.commands.explain import explain
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec
from layout_prop.passes.verify import Verify
from layout_prop.runner import run_graph

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_block.yaml"


def test_the_example_is_what_the_generator_writes():
    assert yaml.safe_load(EXAMPLE.read_text()) == llama_spec(1)


def test_llama_block_needs_the_megatron_collectives(capsys):
    assert main(["check", str(EXAMPLE), "--json"]) == 1  # without --reshard: violations
    out = json.loads(capsys.readouterr().out)
    assert Counter(v["code"] for v in out["violations"]) == {
        "sharding-mismatch": 5,      # sequence-parallel activations into column-parallel q, k, v, gate, up
        "sharded-kv-sequence": 2,    # k and v sharded on sp before attention
        "partial-input": 2,          # row-parallel outputs into the residual adds
    }
    assert main(["check", str(EXAMPLE), "--reshard", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    moves = [(r["node"], r["input"], [(s["kind"], s["mesh_axis"]) for s in r["steps"]]) for r in out["redistributions"]]
    assert moves == [
        # one all-gather of the normed activations on tp serves q, k and v
        ("l0_q", "l0_h", [("all-gather", "tp")]),
        ("l0_attn", "l0_k_rot", [("all-gather", "sp")]),
        ("l0_attn", "l0_v_bnsd", [("all-gather", "sp")]),
        ("l0_res1", "l0_attn_out", [("reduce-scatter", "tp")]),
        ("l0_gate", "l0_h2", [("all-gather", "tp")]),
        ("l0_out", "l0_down", [("reduce-scatter", "tp")]),
    ]
    # activations [2, 8, 32] float32 on (dp, sp, tp): the local [1, 2, 32] block is 256 bytes; the ring
    # all-gather over tp=2 sends one block (256 bytes); the reduce-scatter of the [1, 4, 32] partial sends 256
    assert {r["bytes_per_rank"] for r in out["redistributions"]} == {256}


def test_llama_block_matches_one_device_forward_and_backward():
    rep = run_graph(load_spec(EXAMPLE), backward=True, seed=3)
    assert rep.ok, rep.mismatches
    layer = "model.layers.0."
    assert set(rep.grads) == {"x", *(layer + w for w in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight"))}
    kinds = Counter((c["kind"], c["mesh_axis"]) for c in rep.collectives)
    # weight gradients of replicated-over-dp/sp weights are partial sums: data-parallel all-reduces
    assert kinds[("all-reduce", "dp")] >= 9 and kinds[("all-reduce", "sp")] >= 9


def test_explain_answers_for_every_value_of_the_block():
    a = analyze(load_spec(EXAMPLE), backward=True, reshard=True)
    names = [v for n in a.graph.nodes for v in n.outputs]
    for name in names:
        tree = explain(a.graph, name)
        assert tree["value"] == name and tree["placements"] is not None
    for grad in ("x", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.post_attention_layernorm.weight"):
        assert explain(a.graph, f"grad:{grad}")["value"] == f"grad/{grad}"


def test_32_layer_generated_llama_checks_and_simulates(tmp_path, capsys):
    path = tmp_path / "llama32.yaml"
    # float64 with rtol 1e-9: 32 layers of unscaled random weights grow activations to ~1e5, so a
    # different summation order alone gives relative differences of ~1e-12 per value (float32: ~1e-5),
    # while a wrong layout gives errors of order 1
    assert main(["gen", "llama", "--layers", "32", "--dtype", "float64", "-o", str(path)]) == 0
    graph = load_spec(path)
    assert len([n for n in graph.nodes if not n.is_input]) == 32 * 23  # norm, 3 x (linear, reshape, transpose), 2 RPE, attention, ..., 2 residual adds
    a = analyze(graph, reshard=True, backward=True)
    assert a.ok
    Verify(resolved=True).run(a.graph)
    rep = run_graph(load_spec(path), backward=True, seed=1, rtol=1e-9)
    assert rep.ok, rep.mismatches
    assert len(rep.grads) == 1 + 32 * 9


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".JSON"])
def test_a_generated_spec_file_checks_clean(tmp_path, capsys, suffix):
    # gen writes eps as 1e-06 in JSON, which PyYAML alone read as the string '1e-06' (invalid-attr)
    path = tmp_path / f"llama{suffix}"
    assert main(["gen", "llama", "--layers", "2", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--reshard", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert load_spec(path).node("l1_h").attrs["eps"] == 1e-6
    # the format follows the suffix, in any case (a new-user audit found .JSON written as YAML)
    assert path.read_text().startswith("{") == (suffix.lower() == ".json")


@pytest.mark.parametrize("dtype, code", [("float16", 0), ("float64", 0), ("int32", 2), ("bool", 2)])
def test_gen_writes_only_dtypes_its_model_can_run(tmp_path, capsys, dtype, code):
    # an integer Llama could not run (the audit: run exited 1 with invalid-dtype): gen refuses it
    path = tmp_path / "llama.json"
    assert main(["gen", "llama", "--dtype", dtype, "-o", str(path)]) == code
    if code == 0:
        capsys.readouterr()
        assert main(["check", str(path), "--reshard"]) == 0


def test_gen_rejects_a_bad_mesh(capsys):
    # an axis left out has size 1 (gen --mesh pp=8,dp=24,tp=8 writes sp=1); an axis gen does not take is refused
    assert main(["gen", "llama", "--mesh", "dp=2,xp=2"]) == 2
    assert "bad-mesh" in capsys.readouterr().err
