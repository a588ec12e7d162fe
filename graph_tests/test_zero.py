"""ZeRO stages 1, 2 and 3 (passes/zero.py): one training step on simulated ranks equals one
device's, the per-rank memory equals the ZeRO paper's formulas, and the collectives are the
ones ZeRO places (reduce-scatter instead of all-reduce, gathers before use)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from layout_prop.api import analyze
from layout_prop.core.errors import SpecError
from layout_prop.core.mesh import DeviceMesh
from layout_prop.engines.training import SGD, AdamW, compare_outputs, training_step
from layout_prop.frontends.generate import gpt_spec, llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.passes.lower import Lower
from layout_prop.passes.memory import Memory
from layout_prop.passes.zero import DATA_AXES, Zero, ZeroConfig, finish, parse_zero, shard_layouts
from layout_prop.perf.step import DATA_AXES as STEP_DATA_AXES
from layout_prop.runner import random_inputs

SIZES = dict(batch=4, seq=8, hidden=16, heads=2, vocab=32)


def gpt(mesh, dtype="float32", layers=2):
    return gpt_spec(layers=layers, mesh=mesh, dropout=0.1, dtype=dtype, **SIZES)


def hybrid(spec: dict) -> dict:
    """A gen gpt spec on dp=2 x sp=2 turned into dp=2 x fsdp=2 (HSDP: sharded inside the fsdp
    axis, replicated over dp): the batch is split over both axes."""
    spec = dict(spec, inputs=dict(spec["inputs"]))
    spec["mesh"] = dict(spec["mesh"], names=["dp", "fsdp", "tp"])
    for name in ("tokens", "labels"):
        spec["inputs"][name] = dict(spec["inputs"][name], placements=["S(0)", "S(0)", "R"])
    return spec


#: float64 in the training steps: AdamW's first update is g / (|g| + eps), which turns float32 rounding of a
#: gradient near eps into a visible difference; in float64 the update is compared at 1e-10
CASES = {
    "dp2xtp2": (lambda dtype="float64": gpt((("dp", 2), ("sp", 1), ("tp", 2)), dtype), ("dp",)),
    "dp4": (lambda dtype="float64": gpt((("dp", 4), ("sp", 1), ("tp", 1)), dtype), ("dp",)),
    "hybrid2x2": (lambda dtype="float64": hybrid(gpt((("dp", 2), ("sp", 2), ("tp", 1)), dtype)), ("fsdp",)),
}


def prepared(spec: dict, config: ZeroConfig):
    graph = Zero(config).run(load_spec(spec))
    analysis = analyze(graph, reshard=True, backward=True)
    assert analysis.ok, analysis.check.violations[:3]
    return finish(analysis.graph, config)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_step_matches_one_device(case, stage):
    make, axes = CASES[case]
    config = ZeroConfig(stage, axes if stage else ())
    spec = make()
    graph = prepared(spec, config)
    program = Lower().run(graph).program
    inputs = random_inputs(graph, 0)
    layouts = shard_layouts(graph, config)
    for optimizer in (SGD(lr=0.1, weight_decay=0.01), AdamW()):
        report = training_step(graph, program, inputs, layouts, stage, optimizer, rtol=1e-10)
        assert report.ok, report.mismatches
        assert len(report.params) == 28  # every parameter of the 2-layer GPT updated and compared
    # a rank's optimizer state covers 1/degree of the parameters it computes with (every shard is even here)
    assert report.state_elements[0] * config.degree(graph.mesh) == psi(spec)


def test_two_steps_and_llama():
    """Two AdamW steps (the second uses the first's states) on a 2-layer gen llama --full, ZeRO-3 dp=2 x tp=2."""
    config = ZeroConfig(3, ("dp",))
    spec = llama_spec(layers=2, mesh=(("dp", 2), ("sp", 1), ("tp", 2)), full=True, ffn=32, dtype="float64", **SIZES)
    graph = prepared(spec, config)
    report = training_step(graph, Lower().run(graph).program, random_inputs(graph, 1), shard_layouts(graph, config),
                           3, AdamW(), steps=2, rtol=1e-10)
    assert report.ok, report.mismatches


def test_a_wrong_update_is_caught():
    """The comparison is not vacuous: a rank that skips its shard's update is a mismatch."""
    config = ZeroConfig(1, ("dp",))
    graph = prepared(CASES["dp2xtp2"][0](), config)

    class Lazy(SGD):
        calls = 0

        def update(self, p, g, state, step):
            Lazy.calls += 1
            return p if Lazy.calls == 3 else super().update(p, g, state, step)  # one rank's shard not updated

    report = training_step(graph, Lower().run(graph).program, random_inputs(graph, 0), shard_layouts(graph, config),
                           1, Lazy())
    assert not report.ok and len(report.mismatches) == 1


def collectives(graph):
    return Counter((op.step.kind, graph.mesh.names[op.step.mesh_axis]) for op in Lower().run(graph).program.collectives)


def test_collectives_of_each_stage():
    """Stage 0 all-reduces the gradients over dp; stages 1 and 2 reduce-scatter them instead; stage 3 also
    gathers every parameter once in the forward and again in the backward (28 parameters, the tied embedding
    read by the first layer and the head: 29 forward gathers)."""
    spec = CASES["dp2xtp2"][0]()
    counts = {stage: collectives(prepared(spec, ZeroConfig(stage, ("dp",) if stage else ()))) for stage in range(4)}
    assert counts[0][("all-reduce", "dp")] > 0 and counts[0][("reduce-scatter", "dp")] == 0
    for stage in (1, 2):
        assert counts[stage][("all-reduce", "dp")] == 0
        assert counts[stage][("reduce-scatter", "dp")] == counts[0][("all-reduce", "dp")]
    graph = prepared(spec, ZeroConfig(3, ("dp",)))
    gathers = [n for n in graph.nodes if n.name.startswith("zero/gather/")]
    regathers = [n for n in graph.nodes if n.name.startswith("zero/regather/")]
    assert len(gathers) == 29 and 0 < len(regathers) <= 29
    assert counts[3][("all-reduce", "dp")] == 0
    assert counts[3][("all-gather", "dp")] >= len(gathers) + len(regathers)
    assert counts[3][("reduce-scatter", "dp")] > 0


def test_stage3_frees_the_gathered_copy():
    """With the backward's own re-gather, the forward's gathered parameters die after their last forward use:
    the activation peak is lower than when the backward reads the forward's copies."""
    config = ZeroConfig(3, ("dp",))
    analysis = analyze(Zero(config).run(load_spec(gpt((("dp", 2), ("sp", 1), ("tp", 2)), layers=4))),
                       reshard=True, backward=True)
    kept = Memory(zero=config).run(analysis.graph).max.activations
    freed = Memory(zero=config).run(finish(analysis.graph, config)).max.activations
    assert freed < kept


def test_hybrid_shards_inside_and_replicates_across():
    config = ZeroConfig(3, ("fsdp",))
    graph = prepared(CASES["hybrid2x2"][0](), config)
    c_attn = graph.node("transformer.h.0.attn.c_attn.weight")  # (in, out), out cut on tp: in cut on fsdp
    assert c_attn.meta["specs"][0].layout.placement_strs()[:2] == ["R", "S(0)"]
    counts = collectives(graph)
    assert counts[("all-gather", "fsdp")] > 0 and counts[("reduce-scatter", "fsdp")] > 0
    assert counts[("all-reduce", "dp")] > 0  # the gradients still all-reduced across dp
    program = Lower().run(graph).program
    gathered_on = {graph.mesh.names[op.step.mesh_axis] for op in program.collectives if op.source.startswith("zero/")}
    assert gathered_on == {"fsdp"}  # parameters replicated across dp: gathered on fsdp only


# ---------------------------------------------------------------- memory against the ZeRO paper
def psi(spec: dict) -> int:
    """Parameters a rank holds without ZeRO, counted from the spec: each parameter's elements divided by
    the sizes of the mesh axes that shard it (every shard is even here)."""
    sizes = dict(zip(spec["mesh"]["names"], spec["mesh"]["shape"]))
    total = 0
    for name, inp in spec["inputs"].items():
        if inp.get("dtype") in ("int64", "int32"):
            continue
        cut = [size for size, p in zip(sizes.values(), inp["placements"]) if p.startswith(("S", "_S"))]
        split = math.prod(cut)
        total += math.prod(inp["shape"]) // split
    return total


@pytest.mark.parametrize("case", ["dp2xtp2", "dp4", "hybrid2x2"])
def test_memory_matches_the_zero_paper(case):
    """Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
    section 5.1 and figure 1, mixed precision with Adam (K = 12: an fp32 master copy, momentum and
    variance): per device (2 + 2 + K) Psi without ZeRO, 2 Psi + 2 Psi + K Psi / Nd for P_os,
    2 Psi + (2 + K) Psi / Nd for P_os+g, (2 + 2 + K) Psi / Nd for P_os+g+p."""
    make, axes = CASES[case]
    spec = make("float16")
    p = psi(spec)
    nd = math.prod(dict(zip(spec["mesh"]["names"], spec["mesh"]["shape"]))[a] for a in axes)
    k = 12
    paper = {0: (2 * p, 2 * p, k * p), 1: (2 * p, 2 * p, k * p // nd), 2: (2 * p, 2 * p // nd, k * p // nd),
             3: (2 * p // nd, 2 * p // nd, k * p // nd)}
    for stage in range(4):
        config = ZeroConfig(stage, axes if stage else ())
        m = Memory("adam", zero=config).run(prepared(spec, config))
        assert not m.differ
        assert (m.max.parameters, m.max.gradients, m.max.optimizer_states) == paper[stage], stage


def test_fp32_adam_keeps_no_master_copy():
    spec = CASES["dp4"][0]("float32")
    config = ZeroConfig(1, ("dp",))
    m = Memory("adam", zero=config).run(prepared(spec, config)).max
    assert m.optimizer_states == 8 * psi(spec) // 4  # two fp32 moments, a quarter per rank


# ---------------------------------------------------------------- the spec block
def test_parse_zero():
    mesh = DeviceMesh((2, 2, 2), ("dp", "fsdp", "tp"))
    assert parse_zero(3, mesh) == ZeroConfig(3, ("dp", "fsdp"))
    assert parse_zero({"stage": 2, "axes": ["fsdp"]}, mesh) == ZeroConfig(2, ("fsdp",))
    assert parse_zero(0, mesh) == ZeroConfig(0, ())
    for bad, code in ((4, "bad-value"), ({"stage": 1, "axes": ["tp"]}, "bad-value"), ({"stage": 1, "axes": "dp"},
                      "bad-type"), ({"stage": 1, "shard": 2}, "unknown-key"), (True, "bad-value")):
        with pytest.raises(SpecError) as err:
            parse_zero(bad, mesh)
        assert err.value.code == code
    with pytest.raises(SpecError):
        parse_zero(1, DeviceMesh((2,), ("tp",)))
    assert DATA_AXES == STEP_DATA_AXES


def test_zero_changes_no_forward_value():
    """Stage 3's gathers change no output or gradient: the finished graph runs equal to one device."""
    config = ZeroConfig(3, ("dp",))
    graph = prepared(CASES["dp2xtp2"][0](), config)
    errors = compare_outputs(graph, Lower().run(graph).program, random_inputs(graph, 0))
    assert len(errors) == 29  # the loss and 28 gradients


# ---------------------------------------------------------------- the step model
def test_step_model_prices_zero():
    """On a100-80g, a 2-layer 7B-shaped GPT (hidden 4096, seq 2048, fp16) on dp=8 x tp=8, 8 micro-batches: the
    optimizer updates 1/8 from stage 1 on; stages 1 and 2 move a reduce-scatter and an all-gather where stage 0
    all-reduces (about the same time: measured 16.2 ms against 15.1); stage 2 reduce-scatters every micro-batch;
    stage 3 adds the parameter gathers; memory per rank falls stage by stage."""
    from layout_prop.perf.clusters import get_cluster
    from layout_prop.perf.step import estimate_step

    spec = gpt_spec(layers=2, mesh=(("dp", 8), ("sp", 1), ("tp", 8)), batch=8, seq=2048, hidden=4096, heads=32,
                    vocab=32000, dropout=0.1, dtype="float16")
    cluster = get_cluster("a100-80g")
    est = {}
    for stage in range(4):
        config = ZeroConfig(stage, ("dp",) if stage else ())
        est[stage] = estimate_step(prepared(spec, config), cluster, zero=config, global_batch=64, micro_batch=1)
    assert est[1].optimizer_s == pytest.approx(est[0].optimizer_s / 8)
    assert est[0].grad_sync_s < est[1].grad_sync_s < 1.2 * est[0].grad_sync_s
    assert est[2].grad_sync_s > 3 * est[1].grad_sync_s  # 8 reduce-scatters and one all-gather against one each
    assert est[3].zero_gather_s > 0 and est[3].grad_sync_s > est[2].grad_sync_s
    assert est[3].grad_sync_exposed_s <= est[3].grad_sync_s
    config = ZeroConfig(3, ("dp",))
    exposed = estimate_step(prepared(spec, config), cluster, zero=config, global_batch=64, micro_batch=1,
                            overlap=False)
    assert exposed.grad_sync_exposed_s == pytest.approx(exposed.grad_sync_s)  # nothing hidden without overlap
    assert exposed.grad_sync_s == pytest.approx(est[3].grad_sync_s)
    memory = [est[stage].memory_per_rank_bytes for stage in range(4)]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4


def test_memory_agrees_with_the_search_model():
    """perf/parallel.py (the configuration search's own formula, Rajbhandari et al. figure 1) gives the same
    model-state bytes per rank as the memory pass on the graph, at every stage."""
    from layout_prop.perf.parallel import zero_model_state_bytes

    spec = CASES["dp2xtp2"][0]("float16")
    for stage in range(4):
        config = ZeroConfig(stage, ("dp",) if stage else ())
        m = Memory("adam", zero=config).run(prepared(spec, config)).max
        assert m.parameters + m.gradients + m.optimizer_states == zero_model_state_bytes(psi(spec), stage, 2, 2)


# ---------------------------------------------------------------- the command line
def test_estimate_command_with_zero(tmp_path):
    import json
    import subprocess
    import sys

    import yaml

    spec = CASES["dp2xtp2"][0]("float16")
    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump({**spec, "zero": {"stage": 3, "axes": ["dp"]}, "recompute": "full"}))
    out = subprocess.run([sys.executable, "-m", "layout_prop.cli", "estimate", str(path), "--cluster", "a100-80g",
                          "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["breakdown"]["zero_stage"] == 3 and report["breakdown"]["zero_gather_s"] > 0
    path.write_text(yaml.safe_dump({**spec, "zero": {"stage": 2, "axes": ["tp"]}}))
    out = subprocess.run([sys.executable, "-m", "layout_prop.cli", "estimate", str(path), "--cluster", "a100-80g"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "layout-prop: error: bad-value at zero.axes: ZeRO shards over data-parallel axes, not 'tp' (hint: name mesh "
        "axes among ['dp'] (axes named dp, data or fsdp))"]


def test_mixed_precision_step_keeps_a_master_copy():
    """fp16 parameters (the ZeRO paper's mixed precision): each rank's optimizer state holds a float32 master
    copy of its shard; two SGD steps update the master copies and round them to fp16; equal to one device doing
    the same on the whole parameters (SGD: the update is linear in the gradient, so the fp16 rounding of the
    sharded gradients stays at the fp16 tolerance)."""
    import numpy as np

    config = ZeroConfig(2, ("dp",))
    graph = prepared(CASES["dp2xtp2"][0]("float16"), config)
    optimizer = SGD(lr=0.1)
    report = training_step(graph, Lower().run(graph).program, random_inputs(graph, 0), shard_layouts(graph, config),
                           2, optimizer, rtol=1e-2, steps=2)
    assert report.ok, report.mismatches
    state = {}
    optimizer.update(np.ones(3, np.float16), np.ones(3, np.float16), state, 1)
    assert state["master"].dtype == np.float32


def test_transformed_graphs_pass_the_verifier():
    """Zero, then the analysis (verified after every pass), Recompute and finish leave a well-formed, fresh and
    resolved graph, for every case, stage and recompute mode."""
    from layout_prop.passes.recompute import Recompute
    from layout_prop.passes.verify import Verify

    for case, (make, axes) in CASES.items():
        for stage in range(4):
            config = ZeroConfig(stage, axes if stage else ())
            analysis = analyze(Zero(config).run(load_spec(make())), reshard=True, backward=True, verify=True)
            for mode in ("none", "selective", "full"):
                Verify(resolved=True).run(finish(Recompute(mode).run(analysis.graph), config))
