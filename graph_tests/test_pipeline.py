"""Pipeline parallelism: the point-to-point ``permute`` step, schedules, stage assignment and
a pipelined graph run on simulated ranks (and msrun) against one device."""

from __future__ import annotations

import numpy as np
import pytest

from layout_prop import DeviceMesh, Layout, TensorSpec
from layout_prop.core.errors import LayoutError
from layout_prop.core.redistribute import permute_step
from layout_prop.engines.collectives import apply_step
from layout_prop.engines.simulator import Simulator
from layout_prop.passes.lower import LocalOp, Program, permute_op
from layout_prop.perf.clusters import get_cluster
from layout_prop.perf.collectives import collective_time


# --------------------------------------------------------------------------- the permute step
def _pieces(spec: TensorSpec) -> list[np.ndarray]:
    """Rank r's piece: its local shape filled with r (so every move is visible)."""
    return [np.full(spec.local_shape(r), float(r), np.float32) for r in range(spec.mesh.size)]


def test_permute_moves_each_piece_to_the_next_coordinate_of_its_axis():
    mesh = DeviceMesh((3, 2), ("pp", "tp"))  # rank = 2 * pp + tp
    x = TensorSpec((4, 6), "float32", Layout(mesh, ["R", "S(1)"], 2))
    out = apply_step(permute_step(x, "pp", 1), _pieces(x))
    # pp=0 has no sender (zeros); pp=1 holds pp=0's pieces, pp=2 pp=1's, tp coordinate kept
    assert [float(o[0, 0]) for o in out] == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    assert not out[0].any() and not out[1].any()
    ring = apply_step(permute_step(x, "pp", -1, cyclic=True), _pieces(x))
    assert [float(o[0, 0]) for o in ring] == [2.0, 3.0, 4.0, 5.0, 0.0, 1.0]
    on_tp = apply_step(permute_step(x, "tp", 1, cyclic=True), _pieces(x))
    assert [float(o[0, 0]) for o in on_tp] == [1.0, 0.0, 3.0, 2.0, 5.0, 4.0]


def test_permute_bytes_and_its_step_record():
    mesh = DeviceMesh((2, 2), ("pp", "tp"))
    x = TensorSpec((4, 8), "float32", Layout(mesh, ["R", "S(1)"], 2))
    step = permute_step(x, "pp")
    assert step.bytes_per_rank == 4 * 4 * 4  # a rank's piece: 4 x 4 float32
    assert step.to_dict() == {"kind": "permute", "mesh_axis": "pp", "shift": 1, "cyclic": False,
                              "bytes_per_rank": 64}


def test_permute_lowered_runs_on_the_simulator_and_prints_its_peers():
    mesh = DeviceMesh((4,), ("pp",))
    x = TensorSpec((3,), "float64", Layout(mesh, ["R"], 1))
    prog = Program(mesh)
    prog.add(LocalOp("x", "input", "input", (), ("x",), (x,)))
    prog.add(permute_op("x", permute_step(x, 0, 2, cyclic=True), "y", "y"))
    pieces = [np.arange(3.0) + 10 * r for r in range(4)]
    out = Simulator().execute(prog, {}, scattered={"x": pieces})
    assert [o.tolist() for o in out["y"]] == [pieces[2].tolist(), pieces[3].tolist(), pieces[0].tolist(),
                                               pieces[1].tolist()]
    assert "permute on pp shift 2 cyclic: recv from 3, send to 3" in prog.format(1)
    assert prog.op_dict(prog.ops[1], 0)["recv_from"] == 2


@pytest.mark.parametrize("shift, cyclic", [(0, False), (4, True), (-8, True)])
def test_a_permute_that_moves_nothing_is_refused(shift, cyclic):
    x = TensorSpec((4,), "float32", Layout(DeviceMesh((4,), ("pp",)), ["R"], 1))
    with pytest.raises(LayoutError) as info:
        permute_step(x, "pp", shift, cyclic)
    assert info.value.code == "bad-permute"


def test_a_permute_between_unequal_pieces_is_refused():
    x = TensorSpec((3,), "float32", Layout(DeviceMesh((2,), ("cp",)), ["S(0)"], 1))  # pieces of 2 and 1
    with pytest.raises(LayoutError, match="receive a piece of shape"):
        permute_step(x, "cp", 1, cyclic=True)
    with pytest.raises(LayoutError, match="no mesh axis 'pp'"):
        permute_step(x, "pp")


def test_permute_is_one_link_transfer_on_the_axis_placement():
    a100 = get_cluster("a100-80g")
    nbytes = 64 * 2**20
    intra = nbytes / (a100.intra.GBps * 1e9 * a100.link_efficiency) + a100.intra.latency_us * 1e-6
    inter = nbytes / (a100.inter.GBps * 1e9 * a100.link_efficiency) + a100.inter.latency_us * 1e-6
    assert collective_time("permute", nbytes, (8,), 0, a100) == pytest.approx(intra)  # 8 ranks: one node
    assert collective_time("permute", nbytes, (4, 8), 0, a100) == pytest.approx(inter)  # pp across nodes
    assert collective_time("permute", nbytes, (4, 8), 1, a100) == pytest.approx(intra)


def test_permute_in_the_msrun_worker_matches_the_simulator():
    """The worker's emulated permute (int32 words through one all-reduce on the axis's group), run by the
    worker's own op loop and Communicator in threads (test_msrun_local_ops.run_workers): a line on pp of a
    (2, 2) mesh (zeros on pp=0), a ring on tp, float64 and int32, bit for bit.  On msrun itself: below."""
    from graph_tests.test_msrun_local_ops import run_workers

    mesh = DeviceMesh((2, 2), ("pp", "tp"))
    x = TensorSpec((2, 2, 3), "float64", Layout(mesh, ["S(0)", "S(1)"], 3))  # every rank a different piece
    k = TensorSpec((2, 2, 5), "int32", Layout(mesh, ["S(0)", "S(1)"], 3))
    prog = Program(mesh)
    prog.add(LocalOp("x", "input", "input", (), ("x",), (x,)))
    prog.add(LocalOp("k", "input", "input", (), ("k",), (k,)))
    prog.add(permute_op("x", permute_step(x, "pp", 1), "x_next", "x_next"))
    prog.add(permute_op("k", permute_step(k, "tp", 1, cyclic=True), "k_ring", "k_ring"))
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(x.shape), "k": rng.integers(-1000, 1000, k.shape).astype(np.int32)}
    want = Simulator().execute(prog, inputs)
    envs, records = run_workers(prog, [{name: want[name][r] for name in ("x", "k")} for r in range(4)])
    for name in ("x_next", "k_ring"):
        for rank in range(4):
            assert envs[rank][name].dtype == want[name][rank].dtype
            assert np.array_equal(envs[rank][name], want[name][rank]), (name, rank)
    assert not want["x_next"][0].any() and np.array_equal(want["x_next"][2], want["x"][0])
    assert {r["kind"] for rs in records for r in rs} == {"permute"} and all(r["emulated"] for rs in records for r in rs)


# --------------------------------------------------------------------------- schedules
from layout_prop.core.errors import SpecError  # noqa: E402
from layout_prop.passes.schedule import (  # noqa: E402
    Task, bubble_fraction, in_flight, schedule, simulate)


@pytest.mark.parametrize("kind, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1),
                                           ("1f1b", 2, 5, 1), ("interleaved", 4, 8, 2),
                                           ("interleaved", 4, 4, 2), ("interleaved", 2, 6, 3)])
def test_schedules_run_every_task_once_and_their_bubble_is_the_papers(kind, p, m, v):
    orders = schedule(kind, p, m, v)
    for s, order in enumerate(orders):  # stage s: both phases of every micro-batch of each of its v chunks
        chunks = [s + j * p for j in range(v)]
        assert sorted(order) == sorted(Task(k, c, ph) for k in range(m) for c in chunks for ph in "FB")
    # Narayanan et al. SC'21: bubble time fraction (p - 1) / m, interleaved (p - 1) / (v m), by hand:
    want = {("gpipe", 4, 8): 3 / 8, ("1f1b", 4, 8): 3 / 8, ("1f1b", 4, 3): 3 / 3, ("1f1b", 2, 5): 1 / 5,
            ("interleaved", 4, 8): 3 / 16, ("interleaved", 4, 4): 3 / 8, ("interleaved", 2, 6): 1 / 18}[kind, p, m]
    assert bubble_fraction(kind, p, m, v) == pytest.approx(want)
    timeline = simulate(orders, p, v, t_forward=1.0, t_backward=2.0)  # timed with dependencies: the same
    assert timeline.bubble == pytest.approx(want)
    assert timeline.ideal == pytest.approx(3.0 * m)


def test_activations_in_flight_per_stage():
    # GPipe keeps all m; 1F1B min(p - s, m); interleaved 2 (p - s - 1) + (v - 1) p + 1 chunk-activations,
    # on stage 0 p + (p - 1) / v stages' worth (Korthikanti et al. 2022): 4 + 3/2 = 5.5 for p=4, v=2
    assert in_flight(schedule("gpipe", 4, 8)) == [8, 8, 8, 8]
    assert in_flight(schedule("1f1b", 4, 8)) == [4, 3, 2, 1]
    assert in_flight(schedule("1f1b", 4, 2)) == [2, 2, 2, 1]
    peaks = in_flight(schedule("interleaved", 4, 8, 2))
    assert peaks == [2 * (4 - s - 1) + 1 * 4 + 1 for s in range(4)] == [11, 9, 7, 5]
    assert peaks[0] / 2 == 4 + 3 / 2


def test_1f1b_order_on_the_last_and_first_stage():
    orders = schedule("1f1b", 3, 4)
    assert [str(t) for t in orders[2]] == ["F0.2", "B0.2", "F1.2", "B1.2", "F2.2", "B2.2", "F3.2", "B3.2"]
    assert [str(t) for t in orders[0]] == ["F0.0", "F1.0", "F2.0", "B0.0", "F3.0", "B1.0", "B2.0", "B3.0"]


@pytest.mark.parametrize("args, match", [(("zigzag", 2, 4), "unknown pipeline schedule"),
                                         (("interleaved", 4, 6, 2), "multiple of the 4 stages"),
                                         (("1f1b", 2, 4, 2), "needs schedule interleaved"),
                                         (("gpipe", 2, 0), "positive integer")])
def test_impossible_schedules_are_typed_errors(args, match):
    with pytest.raises(SpecError, match=match) as info:
        schedule(*args)
    assert info.value.code == "bad-pipeline"


def test_uneven_chunk_times_and_moves_timed_by_hand():
    """1F1B, p=2, m=2; chunk 0 forward 1, backward 2; chunk 1 forward 3, backward 6; a move 0.5.
    Stage 0: F0 0-1, F1 1-2, B0 waits for B0.1 (10.5) + 0.5: 11-13, B1 waits for B1.1 (19.5) + 0.5: 20-22.
    Stage 1: F0 1.5-4.5, B0 4.5-10.5, F1 10.5-13.5, B1 13.5-19.5."""
    line = simulate(schedule("1f1b", 2, 2), 2, 1, t_forward=[1.0, 3.0], t_backward=[2.0, 6.0], t_move=0.5)
    assert line.makespan == 22.0 and line.ideal == 18.0
    assert line.start[(0, Task(0, 0, "B"))] == 11.0 and line.start[(1, Task(1, 1, "F"))] == 10.5


def test_a_deadlocking_order_is_refused():
    orders = [[Task(0, 0, "B"), Task(0, 0, "F")], [Task(0, 1, "F"), Task(0, 1, "B")]]
    with pytest.raises(SpecError, match="deadlocks"):
        simulate(orders, 2)


# --------------------------------------------------------------------------- a pipelined model, run
from layout_prop.api import analyze  # noqa: E402
from layout_prop.engines.pipeline import execute_pipeline  # noqa: E402
from layout_prop.frontends.generate import gpt_spec, llama_spec  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402
from layout_prop.passes.pipeline import (  # noqa: E402
    PipelineConfig, forward_chunks, lower_pipeline, micro_batch_graph)
from layout_prop.runner import execute_global, random_inputs  # noqa: E402


def with_pipeline(spec: dict, pp: int, block: dict) -> dict:
    """``spec`` with a pipeline axis ``pp`` of size ``pp`` in front of its mesh (every input, and every node's
    placements attr, R on it)."""
    out = {**spec, "mesh": {"shape": [pp] + list(spec["mesh"]["shape"]), "names": ["pp"] + list(spec["mesh"]["names"])},
           "inputs": {name: {**entry, "placements": ["R"] + list(entry["placements"])}
                      for name, entry in spec["inputs"].items()},
           "nodes": [{**node, "attrs": {**node["attrs"], "placements": ["R"] + list(node["attrs"]["placements"])}}
                     if "placements" in node.get("attrs", {}) else node for node in spec["nodes"]],
           "pipeline": {"axis": "pp", **block}}
    return out


def run_pipelined(spec: dict, seed: int = 0, cost=None):
    """(``cost(graph)`` gives the node cost function that balances the stages.)  Analyse one micro-batch on the stage mesh, lower the pipeline, run it on simulated ranks; and the
    whole batch's loss and gradients on one device.  Returns (pipelined program, run, reference)."""
    graph = load_spec(spec)
    config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
    micro, batch_names = micro_batch_graph(graph, config)
    analysis = analyze(micro, reshard=True, backward=True)
    assert analysis.ok, analysis.check.violations[:3]
    node_cost = None if cost is None else cost(analysis.graph)
    pprog = lower_pipeline(analysis.graph, config, graph.mesh, batch_names,
                           forward_chunks(analysis.graph, config, node_cost))
    whole = analyze(load_spec(spec), reshard=True, backward=True).graph  # the whole batch, one device
    inputs = random_inputs(whole, seed)
    reference = execute_global(whole, inputs, wanted=list(whole.outputs))
    m = config.micro_batches
    micro_inputs = [{name: np.split(inputs[name], m, axis=0)[k] for name in batch_names} for k in range(m)]
    shared = {name: value for name, value in inputs.items() if name not in batch_names}
    for name in shared:
        if name.startswith("cotangent/") and config.loss == "mean":  # the batch loss: the mean of M micro-batch losses
            shared[name] = shared[name] / m
    run = execute_pipeline(pprog, micro_inputs, shared)
    return pprog, run, reference


def assert_matches(run, reference, rtol=1e-9):
    assert set(run.values) == set(reference)
    for name, want in reference.items():
        np.testing.assert_allclose(run.values[name], want, rtol=rtol, atol=rtol, err_msg=name)


def test_llama_4_layers_on_pp2_dp2_tp2_1f1b_matches_one_device():
    spec = with_pipeline(llama_spec(layers=4, mesh=(("dp", 2), ("sp", 1), ("tp", 2)), batch=8, full=True,
                                    dtype="float64"), 2, {"micro_batches": 4, "schedule": "1f1b"})
    pprog, run, reference = run_pipelined(spec)
    assert pprog.mesh.size == 8 and pprog.program.mesh.size == 4
    assert_matches(run, reference)
    assert run.in_flight == [2, 1]  # 1F1B: p - s
    assert {mv[2:4] for mv in run.moves} == {(0, 1), (1, 0)}  # activations forward, their gradients back


def chunk_layers(pprog) -> list[list[str]]:
    """The forward nodes of each chunk, in program order."""
    return [[op.source for op in pprog.tasks[(c, "F")] if op.kind == "kernel"] for c in range(pprog.config.chunks)]


def test_gpt_4_layers_on_pp4_uneven_stages_gpipe_matches_one_device():
    """Stages cut mid-layer (chunk 0: embedding and layer 0's attention; 3: layer 3's MLP and the head) and
    the tied embedding: its gradient from the head goes from stage 3 back to stage 0, once a step."""
    spec = with_pipeline(gpt_spec(layers=4, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, dropout=0.0,
                                  dtype="float64"), 4,
                         {"micro_batches": 2, "schedule": "gpipe", "boundaries": ["l0_h2", "l2_h", "l3_fc1"]})
    pprog, run, reference = run_pipelined(spec)
    assert_matches(run, reference)
    chunks = chunk_layers(pprog)
    assert chunks[0][0] == "embedded" and chunks[0][-1] == "l0_res1" and chunks[1][0] == "l0_h2"
    assert chunks[3][0] == "l3_fc1" and chunks[3][-1] == "loss"
    assert [len(c) for c in chunks] != [len(chunks[0])] * 4  # uneven
    assert run.in_flight == [2, 2, 2, 2]  # GPipe: all M
    assert (3, 0) not in {mv[2:4] for mv in run.moves}  # the head's gradient of the tied embedding, stage 3 -> 0,
    assert [mv[1:4] for mv in run.step_moves] == [(1, 3, 0)]  # once, in the last micro-batch
    text = pprog.format(7)
    assert text.startswith("rank 7 of DeviceMesh(pp=4, dp=1, sp=1, tp=2): stage 3 of 4")
    assert "schedule: F0.3 F1.3 B0.3 B1.3" in text and "permute on pp shift 1: recv from 5" in text


def _tied_gpt(pp: int, block: dict, dp: int = 1, tp: int = 2, **blocks) -> dict:
    spec = with_pipeline(gpt_spec(layers=4, mesh=(("dp", dp), ("sp", 1), ("tp", tp)), batch=8, dropout=0.0,
                                  dtype="float64"), pp, block)
    return {**spec, **blocks}


@pytest.mark.parametrize("pp, dp, tp, block, blocks", [
    (2, 1, 2, {"micro_batches": 8, "schedule": "1f1b"}, {}),
    (2, 2, 2, {"micro_batches": 4, "schedule": "gpipe"}, {}),
    (2, 1, 2, {"micro_batches": 4, "schedule": "interleaved", "virtual_stages": 2}, {}),
    (4, 1, 1, {"micro_batches": 4, "schedule": "1f1b"}, {}),
    (2, 2, 1, {"micro_batches": 4, "schedule": "1f1b"}, {"zero": {"stage": 2, "axes": ["dp"]}}),
])
def test_a_tied_embeddings_gradient_crosses_once_a_step_and_matches_one_device(pp, dp, tp, block, blocks):
    """gen gpt ties the head to the embedding table: the head's gradient term (last stage) is summed over the
    micro-batches there and sent to the first stage once, before its last micro-batch's backward (Megatron-LM's
    embedding group all-reduces it once a step), where it was sent every micro-batch; the first stage adds it to
    its own.  The whole batch's gradients equal one device's."""
    from layout_prop.workflows.pipeline import build

    spec = _tied_gpt(pp, block, dp, tp, **blocks)
    if blocks:  # the zero: block is applied by the command's build (the pipeline as run and estimate make it)
        from layout_prop.workflows.pipeline import run_pipeline

        built = build(load_spec(spec))
        pprog = built.program
        assert run_pipeline(built, 0, "sim")["ok"]
    else:
        pprog, run, reference = run_pipelined(spec)
        assert_matches(run, reference)
        m = pprog.config.micro_batches
        assert [mv[:4] for mv in run.step_moves] == [("grad/logits/einsum2", m - 1, pp - 1, 0)]
        assert all(mv[0] != "grad/logits/einsum2" for mv in run.moves)
        assert len(run.moves) == m * sum(len(mvs) for mvs in pprog.moves.values())
    once = [mv for mvs in pprog.step_moves.values() for mv in mvs]
    assert [(mv.value, mv.src_stage, mv.dst_stage, mv.chunk, mv.phase) for mv in once] == [
        ("grad/logits/einsum2", pp - 1, 0, 0, "B")]
    assert all(mv.value != "grad/logits/einsum2" for mvs in pprog.moves.values() for mv in mvs)


def test_a_tied_gradient_once_a_step_in_the_rank_program():
    """The first stage's program says it receives the sum once, the last stage's that it sends it once."""
    spec = _tied_gpt(2, {"micro_batches": 8, "schedule": "1f1b"})
    pprog, _, _ = run_pipelined(spec)
    first, last = pprog.format(0), pprog.format(2)
    assert ("grad/logits/einsum2 = collective() permute on pp shift -1: recv from 2, 8192 bytes, once a step: in "
            "micro-batch 7, the sum over the micro-batches (zeros before)") in first
    assert ("send the sum of grad/logits/einsum2 over the micro-batches, once a step, to stage 0 (rank 0) before "
            "its last micro-batch's backward chunk 0") in last
    receives = [r for t in pprog.to_dict(0)["tasks"] for r in t["receives"]]
    assert [(r["value"], r["once_a_step"]) for r in receives] == [("grad/l1_out/accadd1", False),
                                                                  ("grad/logits/einsum2", True)]
    from layout_prop.commands.pipeline import format_summary
    from layout_prop.workflows.pipeline import build, summary

    text = format_summary(summary(build(load_spec(spec))))
    assert "moves per micro-batch: 2, 4096 bytes per rank" in text
    assert text.splitlines()[-1].startswith("once a step: grad/logits/einsum2 summed over the micro-batches, stage "
                                            "1 -> 0 before the last micro-batch's backward chunk 0, 8192 bytes")


def test_only_a_gradient_term_summed_into_parameters_gradients_is_sent_once():
    """summed_once: the tied head's term qualifies (an add then a reduction, on the receiving stage, into
    grad/embed); not when grad/embed were not summed over the micro-batches, nor on another receiving stage, nor
    a forward activation or a stage input's gradient (read by the layer's backward: products, not sums)."""
    from dataclasses import replace

    from layout_prop.passes.pipeline import summed_once

    graph = load_spec(_tied_gpt(4, {"micro_batches": 2, "schedule": "1f1b"}, tp=1))
    config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
    micro, batch_names = micro_batch_graph(graph, config)
    g = analyze(micro, reshard=True, backward=True).graph
    pprog = lower_pipeline(g, config, graph.mesh, batch_names, forward_chunks(g, config))
    p = config.stages
    grads = set(pprog.grads)
    (tied,) = [mv for mvs in pprog.step_moves.values() for mv in mvs]
    assert summed_once(g, tied, grads, p)
    assert not summed_once(g, tied, grads - {"grad/transformer.wte.weight"}, p)
    assert not summed_once(g, replace(tied, dst_stage=1), grads, p)
    every = [mv for mvs in pprog.moves.values() for mv in mvs]
    assert len(every) == 6 and not any(summed_once(g, mv, grads, p) for mv in every)


def test_llama_interleaved_2_stages_2_virtual_matches_one_device():
    spec = with_pipeline(llama_spec(layers=4, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, full=True,
                                    dtype="float64"), 2,
                         {"micro_batches": 4, "schedule": "interleaved", "virtual_stages": 2})
    pprog, run, reference = run_pipelined(spec)
    assert_matches(run, reference)
    # one layer a chunk: stage 0 holds chunks 0 and 2 (layers 0 and 2), stage 1 chunks 1 and 3
    assert [sorted({LAYER_OF(n) for n in c} - {None}) for c in chunk_layers(pprog)] == [[0], [1], [2], [3]]
    assert run.in_flight == [2 * (2 - s - 1) + 1 * 2 + 1 for s in range(2)] == [5, 3]
    assert {mv[2:4] for mv in run.moves} == {(0, 1), (1, 0)}


def LAYER_OF(name: str):
    match = __import__("re").match(r"^l(\d+)_", name)
    return int(match.group(1)) if match else None


def _op_time_cost(graph):
    """The step-time model's seconds of each node on an A100 (perf.costs.op_time): the default balance.  The
    profile's flat roofline (no device model: on these toy shapes every GEMM is one wave of tiles and one kernel
    launch, whatever its FLOPs, and the balance would not depend on the head's size)."""
    import dataclasses

    from layout_prop.core import meta
    from layout_prop.passes.propagate import value_spec
    from layout_prop.perf.costs import op_cost, op_time

    a100 = dataclasses.replace(get_cluster("a100-80g"), cores=None)

    def seconds(node):
        ins, outs = [value_spec(graph, v) for v in node.inputs], node.meta[meta.SPECS]
        cost = op_cost(node.op, [s.local_shape(0) for s in ins], [s.local_shape(0) for s in outs],
                       [s.itemsize for s in ins], [s.itemsize for s in outs], node.meta[meta.ATTRS],
                       dtype=outs[0].dtype)
        return op_time(cost, a100)
    return seconds


def test_stages_balanced_by_the_step_time_model():
    """A 4096-word head costs as much as several layers: balanced by op_time, stage 1 gets one layer."""
    spec = with_pipeline(llama_spec(layers=4, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, full=True,
                                    vocab=4096, dtype="float64"), 2, {"micro_batches": 2})
    pprog, run, reference = run_pipelined(spec, cost=_op_time_cost)
    assert [sorted({LAYER_OF(n) for n in c} - {None}) for c in chunk_layers(pprog)] == [[0, 1, 2], [3]]
    assert_matches(run, reference)


def _chunk_layer_counts(chunks: dict[str, int]) -> list[int]:
    layers: dict[int, set] = {}
    for name, chunk in chunks.items():
        if LAYER_OF(name) is not None:
            layers.setdefault(chunk, set()).add(LAYER_OF(name))
    return [len(layers[c]) for c in sorted(layers)]


def test_61_layers_on_16_stages():
    graph = load_spec(with_pipeline(llama_spec(layers=61, mesh=(("dp", 1), ("sp", 1), ("tp", 1)), full=True), 16, {}))
    config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
    counts = _chunk_layer_counts(forward_chunks(graph, config))  # one per node: the embedding, head weigh too
    assert sum(counts) == 61 and len(counts) == 16 and set(counts) == {3, 4}
    assert counts[0] == counts[-1] == 3
    given = [4] * 13 + [3] * 3
    config = PipelineConfig.from_spec({"layers": given}, graph.mesh)
    assert _chunk_layer_counts(forward_chunks(graph, config)) == given
    by_index = PipelineConfig.from_spec({"boundaries": [4 * (k + 1) for k in range(12)] + [52, 55, 58]}, graph.mesh)
    assert forward_chunks(graph, by_index) == forward_chunks(graph, config)  # layer indices: the same cut
    with pytest.raises(SpecError, match="boundary 61: the graph has no layer 61"):
        forward_chunks(graph, PipelineConfig.from_spec({"boundaries": list(range(1, 15)) + [61]}, graph.mesh))


def _spec_error(spec: dict, micro: bool = True):
    graph = load_spec(spec)
    with pytest.raises(SpecError) as info:
        config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
        micro_graph, _ = micro_batch_graph(graph, config)
        forward_chunks(micro_graph, config)
    assert "\n" not in str(info.value) and info.value.code == "bad-pipeline"
    return str(info.value)


def test_bad_pipeline_requests_are_one_line_typed_errors():
    small = llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=6, full=True)
    assert "a batch of 6 does not divide into 4 micro-batches" in _spec_error(
        with_pipeline(small, 2, {"micro_batches": 4}))
    assert "4 pipeline chunks (4 stages x 1 virtual) for 2 layers" in _spec_error(with_pipeline(small, 4, {}))
    assert "the pipeline axis 'pp' is not a mesh axis" in _spec_error({**small, "pipeline": {"micro_batches": 2}})
    assert "at pipeline.boundaries[0]" in _spec_error(with_pipeline(small, 2, {"boundaries": ["nowhere"]}))
    sharded = with_pipeline(small, 2, {})
    sharded["inputs"]["model.embed_tokens.weight"]["placements"][0] = "S(0)"
    assert "input 'model.embed_tokens.weight' is S(0) on the pipeline axis 'pp'" in _spec_error(sharded)
    assert "unknown pipeline key(s) ['stage']" in _spec_error(with_pipeline(small, 2, {"stage": 2}))
    huge = _spec_error(with_pipeline(small, 2, {"micro_batches": 10 ** 40}))  # refused before any list is made
    assert "micro-batches make more than 1,048,576 forward tasks" in huge and len(huge) < 300
    no_batch = with_pipeline(small, 2, {"micro_batches": 2, "batch_inputs": []})
    assert "no batch input to cut into 2 micro-batches" in _spec_error(no_batch)


@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 1)])
def test_pipelined_zero3_recomputing_4_layers_on_8_ranks_matches_one_device(dp, tp):
    """Issue #31's done-when: pp=2 x dp=2 x tp=2, ZeRO-3 over dp (passes/zero.py: parameters stored sharded,
    gathered per layer, re-gathered for the backward), full recomputation (passes/recompute.py), 1F1B over
    2 micro-batches: loss and every gradient (in the ZeRO-sharded layout) equal to one device.  pp=2 x dp=4:
    the next layer's norm backward reads a layer's output itself (with tp=2, its forward reshard), which keeps
    the original while the layer's own backward reads the copies."""
    from layout_prop.passes.recompute import Recompute
    from layout_prop.passes.zero import Zero, ZeroConfig, finish

    spec = with_pipeline(gpt_spec(layers=4, mesh=(("dp", dp), ("sp", 1), ("tp", tp)), batch=8, hidden=16, heads=2,
                                  vocab=32, dropout=0.0, dtype="float64"), 2, {"micro_batches": 2})
    # (dropout 0: a dropout mask is drawn for the shape it masks, so one micro-batch's is not a slice of the
    # whole batch's, and the one-device reference on the whole batch would differ by the masks alone)
    graph = load_spec(spec)
    config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
    micro, batch_names = micro_batch_graph(graph, config)
    zero = ZeroConfig(3, ("dp",))
    analysis = analyze(Zero(zero).run(micro), reshard=True, backward=True)
    assert analysis.ok
    g = finish(Recompute("full").run(analysis.graph), zero)
    assert any(n.name.startswith("recompute/") for n in g.nodes) and any(n.name.startswith("zero/") for n in g.nodes)
    pprog = lower_pipeline(g, config, graph.mesh, batch_names, forward_chunks(g, config))
    whole = analyze(load_spec(spec), reshard=True, backward=True).graph
    inputs = random_inputs(whole, 0)
    reference = execute_global(whole, inputs, wanted=list(whole.outputs))
    micro_inputs = [{name: np.split(inputs[name], 2, axis=0)[k] for name in batch_names} for k in range(2)]
    shared = {name: value / 2 if name.startswith("cotangent/") else value
              for name, value in inputs.items() if name not in batch_names}
    run = execute_pipeline(pprog, micro_inputs, shared)
    assert_matches(run, reference)
    stored = pprog.program.specs["transformer.h.0.attn.c_attn.weight"].layout.placement_strs()
    assert "S(1)" in stored[0] or "S(0)" in stored[0]  # sharded on dp as ZeRO-3 stores it


@pytest.mark.parametrize("dp, tp", [(4, 1), (2, 2)])
@pytest.mark.parametrize("zero_stage", [0, 3])
@pytest.mark.parametrize("recompute", [("full", None), ("full", ("l0", "l1")), ("selective", None)])
def test_recomputation_runs_on_its_layers_stage_and_adds_no_move(recompute, zero_stage, dp, tp):
    """A layer's recomputation runs on the stage that holds the layer, in that stage's backward of it: the moves
    of a micro-batch (values, stages, tasks, bytes) are those without recomputation.  (Found measuring: with full
    recomputation stage 0's last layer was recomputed on stage 1, 10 more moves, 479 us a micro-batch of 2, when
    the next layer's norm backward read the layer's output itself: tp=1; with tp=2 it reads its forward reshard.)"""
    from layout_prop.workflows.pipeline import build
    from layout_prop.passes.pipeline import CHUNK, POSITION
    from layout_prop.passes.zero import ZeroConfig

    spec = with_pipeline(gpt_spec(layers=4, mesh=(("dp", dp), ("sp", 1), ("tp", tp)), batch=4, hidden=16, heads=2,
                                  vocab=32, dropout=0.1, dtype="float16"), 2, {"micro_batches": 2})
    zero = ZeroConfig(zero_stage, ("dp",)) if zero_stage else None

    def moves(built):
        pprog = built.program
        return sorted((mv.value, mv.src_stage, mv.dst_stage, mv.chunk, mv.phase, pprog.permute(mv).bytes_per_rank)
                      for mvs in pprog.moves.values() for mv in mvs)

    plain, recomputing = build(load_spec(spec), zero=zero), build(load_spec(spec), zero=zero, recompute=recompute)
    copies = [n for n in recomputing.micro.nodes if n.name.startswith("recompute/")]
    assert copies and not any(n.name.startswith("recompute/") for n in plain.micro.nodes)
    assert moves(recomputing) == moves(plain) and len(moves(plain)) >= 2
    chunk = {n.name: n.meta[CHUNK] for n in plain.micro.nodes if not n.is_input}
    for copy in copies:  # the copy's chunk is its original's, and it runs in that chunk's backward
        original = copy.name[len("recompute/"):]
        assert copy.meta[CHUNK] == chunk[original] and copy.meta[POSITION] >= 2, copy.name



def test_a_node_reading_only_weights_runs_with_its_readers_not_in_the_first_task():
    """A ZeRO-3 re-gather reads only a graph input (the stored weight shard) and is named after the weight, not a
    layer: it runs in the task of its readers, also when those are placed only by their producers (a dead copy's
    bias add, which nothing reads).  (Found with ZeRO-3 and full recomputation: the re-gather of layer 2's
    mlp.c_proj.bias ran in task 0, on stage 0, one move more to its reader on stage 1.)"""
    from layout_prop.core.graph import Graph
    from layout_prop.passes.pipeline import CHUNK, POSITION, assign_positions

    g = Graph(DeviceMesh((2,), ("pp",)))
    g.input("x", shape=(4, 8))
    g.input("transformer.h.1.mlp.c_proj.bias", shape=(8,))
    g.op("l0_fc2", "relu", ["x"])
    g.op("l1_fc2", "relu", ["l0_fc2"])
    g.op("loss", "relu", ["l1_fc2"])
    g.op("zero/regather/transformer.h.1.mlp.c_proj.bias", "relu", ["transformer.h.1.mlp.c_proj.bias"])
    g.op("grad/l1_fc2/copy", "relu", ["l1_fc2"])  # a backward of chunk 1 (position 2)
    g.op("recompute/l1_bias", "add", ["grad/l1_fc2/copy", "zero/regather/transformer.h.1.mlp.c_proj.bias"])
    g.op("unread", "relu", ["transformer.h.1.mlp.c_proj.bias"])  # nothing reads it, it reads only an input
    pos = assign_positions(g, {"l0_fc2": 0, "l1_fc2": 1, "loss": 1}, PipelineConfig(stages=2))
    assert pos["grad/l1_fc2/copy"] == 2 and pos["recompute/l1_bias"] == 2  # by origin, by its producers
    regather = g.node("zero/regather/transformer.h.1.mlp.c_proj.bias")
    assert regather.meta[POSITION] == 2 and regather.meta[CHUNK] == 1  # before: 0, chunk 0
    assert pos["unread"] == 0


def _small_pipeline():
    spec = with_pipeline(llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=2, full=True), 2,
                         {"micro_batches": 2})
    graph = load_spec(spec)
    config = PipelineConfig.from_spec(graph.meta["pipeline"], graph.mesh)
    micro, batch_names = micro_batch_graph(graph, config)
    g = analyze(micro, reshard=True, backward=True).graph
    return g, config, graph.mesh, batch_names


def test_each_rank_program_as_data():
    import json

    g, config, mesh, batch_names = _small_pipeline()
    pprog = lower_pipeline(g, config, mesh, batch_names, forward_chunks(g, config))
    data = pprog.to_dict(3)  # pp=1, tp=1: stage 1
    assert data["stage"] == 1 and data["order"] == [[0, 1, "forward"], [0, 1, "backward"], [1, 1, "forward"],
                                                    [1, 1, "backward"]]
    forward = data["tasks"][0]
    assert forward["receives"][0]["kind"] == "permute" and forward["receives"][0]["from_rank"] == 1
    assert [t["phase"] for t in data["tasks"]] == ["forward", "backward"]
    assert json.dumps(data, sort_keys=True) == json.dumps(
        lower_pipeline(g, config, mesh, batch_names, forward_chunks(g, config)).to_dict(3), sort_keys=True)


def test_the_verifier_catches_a_missing_move_and_an_edge_back_in_time():
    from layout_prop.core.errors import GraphError
    from layout_prop.passes.pipeline import POSITION, assign_positions, pipeline_moves, verify_pipeline

    g, config, _, _ = _small_pipeline()
    assign_positions(g, forward_chunks(g, config), config)
    moves = pipeline_moves(g, config)
    verify_pipeline(g, moves, config)  # as lowered: clean
    with pytest.raises(GraphError) as info:
        verify_pipeline(g, moves[1:], config)
    assert info.value.code == "pipeline-missing-move" and moves[0].value in str(info.value)
    g.node("loss").meta[POSITION] = 0  # the loss made in chunk 1's forward, moved to chunk 0's
    with pytest.raises(GraphError) as info:
        verify_pipeline(g, moves, config)
    assert info.value.code == "pipeline-order"


@pytest.mark.parametrize("tied", [False, True])
def test_2_stage_pipeline_on_4_msrun_workers_matches_the_simulator_and_one_device(tmp_path, tied):
    """gen llama --full, 2 layers, float64, pp=2 x tp=2, 1F1B over 2 micro-batches, one msrun worker a rank
    (passes.pipeline.rank_programs: each rank its own op list, the stage moves as permutes on pp): every
    gradient and the loss bit-equal to the simulator's pipelined run, and equal to one device.  Tied
    (--tie-embeddings): the head's gradient term crosses once, the last stage's sum, zeros before."""
    pytest.importorskip("mindspore")
    from layout_prop.engines.msrun_engine import MsrunEngine
    from layout_prop.engines.pipeline import gather_rank_results
    from layout_prop.passes.pipeline import rank_programs

    spec = with_pipeline(llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, full=True,
                                    dtype="float64", tie_embeddings=tied), 2, {"micro_batches": 2})
    pprog, run, reference = run_pipelined(spec)
    assert bool(pprog.step_moves) == tied and len(run.step_moves) == tied
    programs = rank_programs(pprog)
    whole = analyze(load_spec(spec), reshard=True, backward=True).graph
    inputs = random_inputs(whole, 0)  # as run_pipelined drew them
    given = {}
    for name, value in inputs.items():
        if name in pprog.batch_inputs:
            given.update({f"{name}@mb{k}": piece for k, piece in enumerate(np.split(value, 2, axis=0))})
        else:
            given[name] = value / 2 if name.startswith("cotangent/") else value
    given.update(programs.placeholder_inputs())
    results = MsrunEngine(backend="numpy", timeout=120.0, run_dir=tmp_path).execute(programs, given,
                                                                                   wanted=programs.wanted())
    got = gather_rank_results(programs, results)
    assert set(got) == set(run.values) and len(got) == 22 - tied  # (tied: no head weight)
    for name, value in got.items():
        assert np.array_equal(value, run.values[name]), name
    assert_matches(type(run)(values=got), reference)


# --------------------------------------------------------------------------- the command
def _write_spec(tmp_path, spec: dict, name: str = "pipe.yaml"):
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_pipeline_command_summary_rank_and_run(tmp_path, capsys):
    import json

    from layout_prop.cli import main

    spec = with_pipeline(llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, full=True,
                                    dtype="float64"), 2, {"micro_batches": 2})
    path = _write_spec(tmp_path, spec)
    assert main(["pipeline", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 stages on pp (4 ranks, each stage on DeviceMesh(dp=1, sp=1, tp=2)), 1f1b over 2 "
                          "micro-batches\nbubble 0.500 of the ideal time; activations in flight per stage [2, 1]\n")
    assert "l0_out: stage 0 -> 1 before forward chunk 1, 4096 bytes" in out  # 2 x 8 x 32 float64 per micro-batch
    # l0_out forward and its gradient back, the norm's and the residual's terms summed on stage 1: one message
    assert "grad/l0_out/accadd1: stage 1 -> 0 before backward chunk 0, 4096 bytes" in out
    assert "moves per micro-batch: 2, 8192 bytes per rank, " in out and " us on a100-80g" in out
    assert main(["pipeline", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bubble_fraction"] == data["simulated_bubble"] == 0.5 and data["in_flight"] == [2, 1]
    a100 = get_cluster("a100-80g")  # one intra-node transfer each (the 2 stages sit in one node)
    assert data["moves"][0]["seconds"] == pytest.approx(
        4096 / (a100.intra.GBps * 1e9 * a100.link_efficiency) + a100.intra.latency_us * 1e-6)
    forward, backward = data["chunk_forward_s"], data["chunk_backward_s"]  # the step model's, per chunk
    assert data["step_time_s"] == pytest.approx(simulate(
        schedule("1f1b", 2, 2), 2, 1, forward, backward, t_move=data["moves"][0]["seconds"]).makespan)
    assert data["step_time_s"] > 2 * max(f + b for f, b in zip(forward, backward))  # the busiest stage, and more
    assert main(["pipeline", path, "--rank", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage"] == 1
    assert main(["pipeline", path, "--run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and len(report["grads"]) == 21 and report["outputs"]["loss"]["max_rel_err"] < 1e-12


@pytest.mark.parametrize("block, fragment", [
    ({"micro_batches": 3}, "bad-pipeline at pipeline.micro_batches: a batch of 4 does not divide into 3"),
    ({"schedule": "zigzag"}, "bad-pipeline at pipeline.schedule: unknown pipeline schedule 'zigzag'"),
    ({"axis": "stage"}, "bad-pipeline at pipeline.axis: the pipeline axis 'stage' is not a mesh axis")])
def test_pipeline_command_refuses_bad_requests_in_one_line(tmp_path, capsys, block, fragment):
    from layout_prop.cli import main

    spec = with_pipeline(llama_spec(layers=2, mesh=(("dp", 1), ("sp", 1), ("tp", 2)), batch=4, full=True), 2, block)
    assert main(["pipeline", _write_spec(tmp_path, spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err


def test_moe_on_pp2_dp2_ep2_matches_one_device():
    """gen moe --full: the tokens flattened to (B*S, H) (a reshape whose first entry is a multiple of the batch,
    divided by M), the dispatch to the experts a redistribute whose placements name the pp axis too."""
    from layout_prop.frontends.generate import moe_spec

    spec = with_pipeline(moe_spec(layers=2, mesh=(("dp", 2), ("ep", 2), ("tp", 1)), full=True, dtype="float64"),
                         2, {"micro_batches": 2})
    pprog, run, reference = run_pipelined(spec)
    assert_matches(run, reference)
    shapes = [op.attrs[0]["shape"] for ops in pprog.tasks.values() for op in ops
              if op.op == "reshape" and op.source == "l0_tokens"]
    assert shapes and shapes[0][0] == 4 * 8 // 2 // 2  # B*S of one micro-batch (M=2), rank 0's half on dp=2
    bad = with_pipeline(moe_spec(layers=2, mesh=(("dp", 2), ("ep", 2), ("tp", 1)), full=True), 2, {})
    move = next(node for node in bad["nodes"] if node["op"] == "redistribute")
    move["attrs"]["placements"][0] = "S(0)"
    assert f"node {move['name']!r} asks for S(0) on the pipeline axis 'pp'" in _spec_error(bad)


def test_a_batch_input_gradient_is_one_piece_per_micro_batch(tmp_path, capsys):
    """A mesh of the pipeline axis alone, a float batch input x with a gradient, loss: sum: grad:x is the
    micro-batches' pieces concatenated (not summed), the weights' gradients summed."""
    from layout_prop.cli import main

    spec = {"mesh": {"shape": [2], "names": ["pp"]},
            "inputs": {"x": {"shape": [4, 8], "dtype": "float64"}, **{f"w{i}": {"shape": [8, 8], "dtype": "float64"}
                                                                       for i in range(3)}},
            "nodes": [{"name": "h0", "op": "matmul", "inputs": ["x", "w0"]}, {"name": "a0", "op": "relu", "inputs": ["h0"]},
                      {"name": "h1", "op": "matmul", "inputs": ["a0", "w1"]}, {"name": "a1", "op": "relu", "inputs": ["h1"]},
                      {"name": "h2", "op": "matmul", "inputs": ["a1", "w2"]},
                      {"name": "loss", "op": "sum", "inputs": ["h2"], "attrs": {"dims": [0, 1]}}],
            "outputs": ["loss"],
            "pipeline": {"axis": "pp", "micro_batches": 2, "schedule": "gpipe", "batch_inputs": ["x"], "loss": "sum"}}
    pprog, run, reference = run_pipelined({**spec, "pipeline": {**spec["pipeline"]}}, seed=0)
    assert "grad/x" not in pprog.grads and sorted(pprog.grads) == ["grad/w0", "grad/w1", "grad/w2"]
    assert_matches(run, reference)
    assert main(["pipeline", _write_spec(tmp_path, spec), "--run"]) == 0
    assert "matches one device" in capsys.readouterr().out


def test_balanced_cut_of_long_lists_is_as_good_as_the_exact_one():
    """The bisection with greedy cuts (used past 2e6 DP steps) finds the same least largest stage sum as the
    dynamic programme on 300 random lists (zeros included); 10,000 units cut into 16 stay fast."""
    import random
    import time

    from layout_prop.passes.pipeline import _balanced, _balanced_greedy

    rng = random.Random(0)

    def largest(costs, starts):
        ends = starts[1:] + [len(costs)]
        assert all(a < b for a, b in zip(starts, ends)) and starts[0] == 0  # non-empty, in order
        return max(sum(costs[a:b]) for a, b in zip(starts, ends))

    for _ in range(300):
        n = rng.randint(1, 40)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
        exact, greedy = _balanced(costs, parts), _balanced_greedy(costs, parts)
        assert len(greedy) == parts
        assert largest(costs, greedy) == pytest.approx(largest(costs, exact), rel=1e-9, abs=1e-12)
    start = time.perf_counter()
    assert len(_balanced([rng.random() for _ in range(10_000)], 16)) == 16
    assert time.perf_counter() - start < 2.0


def test_a_micro_batch_too_small_for_its_data_parallel_shards_is_one_line(tmp_path, capsys):
    from layout_prop.cli import main

    spec = with_pipeline(llama_spec(layers=2, mesh=(("dp", 2), ("sp", 1), ("tp", 1)), batch=2, full=True), 2,
                         {"micro_batches": 2})
    assert main(["pipeline", _write_spec(tmp_path, spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad-pipeline at pipeline.micro_batches: one micro-batch (tokens [1, 8], " \
        "labels [1, 8]) on the stage mesh DeviceMesh(dp=2, sp=1, tp=1): dim 0 has size 1 but is sharded" in err
