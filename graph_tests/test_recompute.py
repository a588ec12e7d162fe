"""Activation recomputation (passes/recompute.py): the activations each layer keeps against
Korthikanti et al.'s per-layer formulas, and a recomputing graph still equal to one device."""

from __future__ import annotations

import pytest

from layout_prop.api import analyze
from layout_prop.core.errors import SpecError
from layout_prop.engines.training import compare_outputs
from layout_prop.frontends.generate import gpt_spec
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.passes.memory import Memory
from layout_prop.passes.recompute import Recompute, held_values, layer_activations
from layout_prop.passes.zero import Zero, ZeroConfig, finish
from layout_prop.runner import random_inputs

S, B, H, A, L = 16, 2, 32, 4, 3  # sequence, micro-batch, hidden, heads, layers


def analysed(tp: int, dtype: str = "float16", dp: int = 1):
    spec = gpt_spec(layers=L, mesh=(("dp", dp), ("sp", 1), ("tp", tp)), batch=B, seq=S, hidden=H, heads=A,
                    vocab=16, dropout=0.1, dtype=dtype)
    return analyze(load_spec(spec), reshard=True, backward=True).graph


@pytest.mark.parametrize("tp", [1, 2])
def test_per_layer_activations_against_the_paper(tp):
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4:
    bytes a layer keeps in 16-bit, with 1-byte dropout masks.  Equation 1 (no parallelism):
    sbh (34 + 5 a s / h); equation 2 (tensor parallel t, no sequence parallelism):
    sbh (10 + 24 / t + 5 a s / (h t)); selective recomputation (section 4.2) drops the 5 a s / h term
    (the attention core's scores, softmax, its dropout mask and output: 5 a s^2 b); full recomputation keeps
    the layer's input, 2 sbh.  The layer here differs from the paper's in two named ways: (1) its dropout
    regenerates its mask from the seed in the backward, so the two masks (attention output and MLP output,
    sbh each, in the replicated 10 sbh) are not kept; (2) its attention is one fused op whose backward
    recomputes the scores from q, k, v (as FlashAttention), so the 5 a s^2 b term is never kept, with or
    without selective recomputation."""
    sbh = S * B * H
    masks = 2 * sbh
    attention_core = 5 * A * S * S * B // tp
    paper_none = sbh * 10 + sbh * 24 // tp + attention_core  # equation 2 (equation 1 at t = 1: 34 sbh + 5 a s^2 b)
    paper_selective = paper_none - attention_core
    graph = analysed(tp)
    layers = [f"l{i}" for i in range(L)]
    none = layer_activations(Recompute("none").run(graph))
    assert none == {layer: paper_none - masks - attention_core for layer in layers}
    selective = layer_activations(Recompute("selective").run(graph))
    assert selective == {layer: paper_selective - masks for layer in layers}
    full = Recompute("full").run(graph)
    held = held_values(full)
    inputs = ["embed_drop"] + [f"l{i}_out" for i in range(L - 1)]  # each layer's input
    assert {v: held[v][1] for v in inputs} == {v: 2 * sbh for v in inputs}
    assert sum(nbytes for layer, nbytes in held.values() if layer is not None) == 2 * sbh * (L - 1)  # nothing else


def test_full_recompute_lowers_the_peak_and_per_layer_selects():
    graph = analysed(1)
    peaks = {mode: Memory().run(Recompute(mode).run(graph)).max.activations for mode in ("none", "selective", "full")}
    assert peaks["full"] < peaks["none"] and peaks["selective"] <= peaks["none"]
    one = Recompute("full", layers=["l1"])
    held = layer_activations(one.run(graph))
    assert list(one.recomputed) == ["l1"]
    before = layer_activations(graph)
    # l1 keeps only its output, l2's input (2 sbh in 16-bit), which l2, not recomputed, reads in its backward;
    # l1's input, l0's output, was already held (read by l1's norm backward); l1's copies run after l2's backward
    assert held == {"l0": before["l0"], "l1": 2 * S * B * H, "l2": before["l2"]} and before["l1"] > 2 * S * B * H
    assert Memory().run(one.run(graph)).max.activations < peaks["none"]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputing_graph_matches_one_device(mode):
    """The copies change no number: every output and gradient of a dp=2 x tp=2 GPT (with dropout) equals one
    device, recomputing every layer, and with ZeRO-3 (its re-gathers then also serve the copies)."""
    graph = Recompute(mode).run(analysed(2, "float64", dp=2))
    errors = compare_outputs(graph, Lower().run(graph).program, random_inputs(graph, 0), rtol=1e-10)
    assert len(errors) > 30
    config = ZeroConfig(3, ("dp",))
    spec = gpt_spec(layers=2, mesh=(("dp", 2), ("sp", 1), ("tp", 2)), batch=4, seq=8, hidden=16, heads=2,
                    vocab=32, dropout=0.1, dtype="float64")
    zero = finish(Recompute(mode).run(analyze(Zero(config).run(load_spec(spec)), reshard=True, backward=True).graph),
                  config)
    copies = [n for n in zero.nodes if n.name.startswith("recompute/")]
    assert copies and not any(v.startswith("zero/gather/") for n in copies for v in n.inputs)
    compare_outputs(zero, Lower().run(zero).program, random_inputs(zero, 0), rtol=1e-10)


def test_bad_mode():
    with pytest.raises(SpecError) as err:
        Recompute("some")
    assert err.value.code == "bad-value"


def unfused_attention_spec(b=2, s=8, n=2, d=4) -> dict:
    """One layer of attention written out op by op (as an imported model may be): q k^T, softmax, times v."""
    h = n * d
    weights = {w: {"shape": [h, h], "placements": ["R", "S(1)"], "dtype": "float64"} for w in ("wq", "wk", "wv")}
    nodes = []
    for x in "qkv":
        nodes += [{"name": f"l0_{x}", "op": "matmul", "inputs": ["x", f"w{x}"]},
                  {"name": f"l0_{x}h", "op": "reshape", "inputs": [f"l0_{x}"], "attrs": {"shape": [b, s, n, d]}},
                  {"name": f"l0_{x}t", "op": "transpose", "inputs": [f"l0_{x}h"],
                   "attrs": {"dims": [0, 2, 3, 1] if x == "k" else [0, 2, 1, 3]}}]
    nodes += [{"name": "l0_scores", "op": "batch_matmul", "inputs": ["l0_qt", "l0_kt"]},
              {"name": "l0_probs", "op": "softmax", "inputs": ["l0_scores"], "attrs": {"axis": -1}},
              {"name": "l0_ctx", "op": "batch_matmul", "inputs": ["l0_probs", "l0_vt"]},
              {"name": "out", "op": "sum", "inputs": ["l0_ctx"]}]
    return {"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
            "inputs": {"x": {"shape": [b, s, h], "placements": ["S(0)", "R"], "dtype": "float64"}, **weights},
            "nodes": nodes, "outputs": ["out"]}


def test_selective_recomputes_an_unfused_attention_core():
    """On attention written op by op, selective recomputation copies the (b, n, s, s) ops (the scores and the
    softmax) and frees the probabilities the second product's backward read: b n s^2 / (dp tp) float64 items
    (1 x 1 x 8 x 8 x 8 = 512 bytes a rank); q, k, v stay; the values are unchanged."""
    graph = analyze(load_spec(unfused_attention_spec()), reshard=True, backward=True).graph
    none = layer_activations(graph)["l0"]
    selective = Recompute("selective")
    copied = selective.run(graph)
    assert selective.recomputed == {"l0": ["recompute/l0_scores", "recompute/l0_probs"]}
    assert none - layer_activations(copied)["l0"] == 1 * 1 * 8 * 8 * 8
    assert {v for v, (layer, _) in held_values(copied).items() if layer} == {"l0_qt", "l0_kt", "l0_vt"}
    compare_outputs(copied, Lower().run(copied).program, random_inputs(copied, 0), rtol=1e-10)


def test_recompute_per_pipeline_stage():
    """Per stage: the layers passes/pipeline.py puts on stage 0 of a 4-layer GPT on pp=2 are recomputed, the
    others not."""
    from layout_prop.passes.pipeline import PipelineConfig, forward_chunks, micro_batch_graph
    from layout_prop.passes.recompute import layers_on_stages

    spec = gpt_spec(layers=4, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=2, seq=8, hidden=16, heads=2, vocab=16)
    spec = {**spec, "mesh": {"shape": [2, 1, 1, 2], "names": ["pp", "dp", "sp", "tp"]},
            "inputs": {k: {**v, "placements": ["R"] + list(v["placements"])} for k, v in spec["inputs"].items()},
            "pipeline": {"axis": "pp", "micro_batches": 2}}
    graph = load_spec(spec)
    config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
    micro, _ = micro_batch_graph(graph, config)
    analysed = analyze(micro, reshard=True, backward=True).graph
    layers = layers_on_stages(forward_chunks(analysed, config), config.stages, [0])
    assert layers == ("l0", "l1")
    recompute = Recompute("full", layers)
    held = layer_activations(recompute.run(analysed))
    assert sorted(recompute.recomputed) == ["l0", "l1"] and held["l2"] == held["l3"] > held["l0"]


def test_bad_recompute_and_zero_blocks_are_typed_errors():
    from layout_prop.passes.recompute import parse_recompute

    assert parse_recompute({"mode": "full", "layers": ["l1"]}) == ("full", ("l1",))
    for bad, code in (("most", "bad-value"), ({"mode": "full", "layers": "l1"}, "bad-type"),
                      ({"mode": "full", "stage": 1}, "unknown-key")):
        with pytest.raises(SpecError) as err:
            parse_recompute(bad)
        assert err.value.code == code
    with pytest.raises(SpecError) as err:
        Recompute("full", ["l9"]).run(analysed(1))
    assert err.value.code == "bad-value" and "l9" in err.value.message
    spec = gpt_spec(layers=1, mesh=(("dp", 2), ("sp", 1), ("tp", 1)), batch=2, seq=8, hidden=16, heads=2, vocab=16)
    with pytest.raises(SpecError) as err:
        load_spec({**spec, "zero": [3]})
    assert err.value.code == "bad-type" and err.value.path == "zero"
    assert load_spec({**spec, "zero": {"stage": 2}, "recompute": "selective"}).meta["zero"] == {"stage": 2}
