"""The planner against its baseline and its clock: never a plan worse than the baseline under its
own objective and memory limit, "optimal among the N strategies kept per node" when it pruned,
a time limit over the whole command, and the time objective on a cluster (issue #30)."""

import json
import time

import pytest

import layout_prop.planner.solver as solver
from layout_prop.cli import main
from layout_prop.workflows.plan import measure, plan_spec
from layout_prop.io.loader import load_spec
from layout_prop.runner import run_graph

MLP = """
mesh: {shape: [2], names: [tp]}
inputs:
  x:  {shape: [8, 16], requires_grad: false}
  w1: {shape: [16, 32], placements: W1}
  w2: {shape: [32, 16], placements: W2}
nodes:
  - {name: h, op: matmul, inputs: [x, w1]}
  - {name: a, op: gelu, inputs: [h]}
  - {name: y, op: matmul, inputs: [a, w2]}
outputs: [y]
"""


def _mlp(w1="auto", w2="auto"):
    return MLP.replace("W1", w1 if w1 == "auto" else f'["{w1}"]').replace("W2", w2 if w2 == "auto" else f'["{w2}"]')


MEGATRON = _mlp("S(1)", "S(0)")  # column- then row-parallel: no forward bytes


def _forced_worse(monkeypatch):
    """The solver made to plan as if w1 were declared S(0) (rows): a plan that must move bytes."""
    real = solver.solve

    def worse(graph, **kwargs):
        pinned = graph.copy_structure()
        pinned.node("w1").attrs["placements"] = ("S(0)",)
        return real(pinned, **kwargs)

    monkeypatch.setattr(solver, "solve", worse)


def test_a_worse_plan_is_not_reported_the_baseline_is(monkeypatch):
    _forced_worse(monkeypatch)
    report = plan_spec(load_spec(_mlp()), backward=False, baseline=load_spec(MEGATRON))
    assert report.solver["kept"] == "baseline"
    assert (report.layouts["w1"], report.layouts["w2"]) == (["S(1)"], ["S(0)"])
    assert report.plan == report.baseline and report.plan["forward_bytes_per_rank"] == 0
    assert any("the baseline beats the plan found under the bytes objective" in n for n in report.notes)
    # what is written is the baseline, and measures as the baseline did
    written = load_spec(report.spec)
    assert measure(written) == report.baseline
    assert run_graph(written, backward=True).ok
    assert "the baseline is kept" in report.format().splitlines()[0]


def test_without_the_forced_detour_the_solver_plan_is_kept():
    report = plan_spec(load_spec(_mlp()), backward=False, baseline=load_spec(_mlp("R", "R")))
    assert report.solver["kept"] == "plan"
    assert report.plan["forward_bytes_per_rank"] == 0  # as the baseline, in half its memory
    assert report.plan["memory_per_rank"]["total"] < report.baseline["memory_per_rank"]["total"]


def test_a_baseline_over_the_memory_limit_is_not_kept(monkeypatch):
    _forced_worse(monkeypatch)
    megatron = measure(load_spec(MEGATRON))
    limit = megatron["memory_per_rank"]["total"] - 1
    try:
        report = plan_spec(load_spec(_mlp()), backward=False, baseline=load_spec(MEGATRON), memory_limit=limit)
    except solver.InfeasiblePlan as err:
        assert err.limit == limit
        return
    assert report.solver["kept"] == "plan" and report.plan["memory_per_rank"]["total"] <= limit


def test_the_baseline_kept_on_the_command_line_is_what_is_written(tmp_path, capsys, monkeypatch):
    _forced_worse(monkeypatch)
    spec, base, out = tmp_path / "auto.yaml", tmp_path / "megatron.yaml", tmp_path / "planned.yaml"
    spec.write_text(_mlp())
    base.write_text(MEGATRON)
    assert main(["plan", str(spec), "--baseline", str(base), "--forward-only", "-o", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["solver"]["kept"] == "baseline" and data["plan"] == data["baseline"]
    assert measure(load_spec(out)) == data["baseline"]


def test_the_time_running_out_reports_the_baseline(tmp_path, capsys):
    spec = tmp_path / "auto.yaml"
    spec.write_text(_mlp())
    assert main(["plan", str(spec), "--time-limit", "0.001", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["solver"]["kept"] == "baseline" and data["solver"]["time_limit"] == 0.001
    assert any("the time limit of 0.001 s ran out" in n for n in data["notes"])


def test_the_time_running_out_with_no_plan_that_fits_is_one_line_exit_2(tmp_path, capsys):
    spec = tmp_path / "auto.yaml"
    spec.write_text(_mlp())
    assert main(["plan", str(spec), "--time-limit", "0.001", "--memory-per-rank", "1KiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plan-timeout" in err and "0.001 s" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e6", "soon"])
def test_bad_time_limits_are_one_line_exit_2(tmp_path, capsys, value):
    spec = tmp_path / "auto.yaml"
    spec.write_text(_mlp())
    assert main(["plan", str(spec), f"--time-limit={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--time-limit" in err


def test_the_time_limit_bounds_a_slow_plan():
    """A one-layer all-auto Llama on dp=2 x sp=2 x tp=2 takes about 30 s to plan unbounded (loaded
    machine); within a 6 s limit the command returns in about 6 s, with the baseline or a plan."""
    from layout_prop.frontends.generate import llama_spec

    spec = llama_spec(1, (("dp", 2), ("sp", 2), ("tp", 2)))
    for name, inp in spec["inputs"].items():
        if name not in ("x", "cos", "sin"):
            inp["placements"] = "auto"
    start = time.perf_counter()
    report = plan_spec(load_spec(spec), time_limit=6.0)
    seconds = time.perf_counter() - start
    assert seconds < 6.0 + 2.0, seconds  # the last check to the return: one measurement at most
    assert report.solver["seconds"] <= seconds
    assert report.plan["bytes_per_step"] <= report.baseline["bytes_per_step"]


def test_pruned_strategies_are_said_optimal_among_those_kept(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(solver, "CAP", 2)
    report = plan_spec(load_spec(_mlp()), backward=False)
    s = report.solver
    assert s["pruned_nodes"] > 0 and s["strategies_kept_per_node"] == 2
    assert s["optimal"] is False and s["optimality"] == "optimal among the 2 strategies kept per node"
    head = report.format().splitlines()[0]
    assert "optimal among the 2 strategies kept per node" in head and "proven optimal" not in head


def test_unpruned_plans_are_proven_optimal():
    report = plan_spec(load_spec(_mlp()), backward=False)
    assert report.solver["pruned_nodes"] == 0 and report.solver["optimal"] is True
    assert report.solver["optimality"] == "proven optimal"


# --------------------------------------------------------------------------- the time objective on a cluster
LLAMA_MESH = (("dp", 2), ("sp", 1), ("tp", 4))
LLAMA_SIZES = dict(seq=2048, hidden=1024, heads=8, ffn=4096, dtype="float16")
MATMUL_WEIGHTS = tuple(f"model.layers.0.{w}.weight" for w in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                               "mlp.down_proj"))


def _auto_llama():
    from layout_prop.frontends.generate import llama_spec

    spec = llama_spec(1, LLAMA_MESH, **LLAMA_SIZES)
    for name, inp in spec["inputs"].items():
        if name == "x":
            inp["placements"] = ["S(0)", "R", "R"]
        elif name not in ("cos", "sin"):
            inp["placements"] = "auto"
    return spec


def _planned(graph, solution):
    planned = graph.copy_structure()
    for node in planned.inputs():
        node.attrs["placements"] = solution.layouts[node.name]
    return solver.realise(planned, solution.strategies)[0]


def test_time_on_a100_shards_the_weights_that_bytes_keep_replicated():
    """Llama, dp=2 x tp=4, fp16, seq 2048, hidden 1024, every weight auto: the bytes objective
    replicates every weight (no collective but one of x); the step time on a100-80g, compute
    included, shards the weights (measured: q, k, v on tp, the MLP's on dp, wo replicated), and
    the estimate's model, measuring the realised plans, puts it ahead of the bytes plan and of
    Megatron's layouts."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.perf.clusters import get_cluster

    a100 = get_cluster("a100-80g")
    graph = load_spec(_auto_llama())
    by_bytes = solver.solve(graph)
    by_time = solver.solve(graph, objective="time", cluster=a100)
    assert all(set(by_bytes.layouts[w]) == {"R"} for w in MATMUL_WEIGHTS)
    sharded = [w for w in MATMUL_WEIGHTS if any(p.startswith("S(") for p in by_time.layouts[w])]
    assert len(sharded) >= 5, by_time.layouts
    bytes_plan = measure(_planned(graph, by_bytes), cluster=a100)
    time_plan = measure(_planned(graph, by_time), cluster=a100)
    assert bytes_plan["bytes_per_step"] < time_plan["bytes_per_step"]
    assert time_plan["step_time_s"] < 0.5 * bytes_plan["step_time_s"]
    assert time_plan["memory_per_rank"]["total"] < bytes_plan["memory_per_rank"]["total"]
    # and against Megatron's layouts the command reports whichever measures the faster step
    megatron = load_spec(llama_spec(1, LLAMA_MESH, **LLAMA_SIZES))
    report = plan_spec(graph, objective="time", cluster=a100, baseline=megatron)
    assert report.solver["kept"] == "plan" and report.plan["step_time_s"] < report.baseline["step_time_s"]


def test_a_cluster_makes_time_the_default_objective(tmp_path, capsys):
    spec = tmp_path / "auto.yaml"
    spec.write_text(_mlp())
    assert main(["plan", str(spec), "--cluster", "a100-80g", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["solver"]["objective"] == "time" and data["solver"]["cluster"] == "a100-80g"
    assert data["plan"]["step_time_s"] > 0 and data["baseline"]["step_time_s"] > 0
    assert main(["plan", str(spec), "--cluster", "a100-80g", "--objective", "bytes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["solver"]["objective"] == "bytes"
    assert main(["plan", str(spec), "--cluster", "a100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown-cluster" in err


def test_a_time_plan_runs_equal_to_one_device():
    """The plan the time objective picks on a small Llama (weights auto, dp=2 x tp=2) is
    realised with explicit moves, and its lowered per-rank run, forward and backward, equals
    one device."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.perf.clusters import get_cluster

    spec = llama_spec(1, (("dp", 2), ("sp", 1), ("tp", 2)), seq=16, hidden=32, heads=4, ffn=64)
    for name, inp in spec["inputs"].items():
        if name not in ("x", "cos", "sin"):
            inp["placements"] = "auto"
    report = plan_spec(load_spec(spec), objective="time", cluster=get_cluster("a100-80g"))
    assert report.plan["ok"] and report.solver["objective"] == "time"
    assert run_graph(load_spec(report.spec), backward=True).ok


def test_the_baseline_layouts_stay_candidates_however_few_are_kept(monkeypatch):
    """With one strategy kept per node, the solver alone settles on replicated weights; given
    Megatron's layouts as the baseline, they stay among the candidates and the solver finds them
    (as cheap in bytes, in less memory)."""
    monkeypatch.setattr(solver, "CAP", 1)
    alone = plan_spec(load_spec(_mlp()), backward=False, baseline=load_spec(_mlp("R", "R")))
    assert (alone.layouts["w1"], alone.layouts["w2"]) == (["R"], ["R"])
    seeded = plan_spec(load_spec(_mlp()), backward=False, baseline=load_spec(MEGATRON))
    assert seeded.solver["kept"] == "plan" and seeded.solver["pruned_nodes"] > 0
    assert (seeded.layouts["w1"], seeded.layouts["w2"]) == (["S(1)"], ["S(0)"])
    assert seeded.plan["forward_bytes_per_rank"] == 0


def test_the_forward_time_the_solver_models_is_what_estimate_measures():
    """For inference (--forward-only) the solver's objective on a cluster, op by op and move by
    move, is what the estimate's model measures walking the realised plan (its forward compute
    and communication), within 5%: two ways of counting the same step (measured: 166.7 us
    modelled, 168.7 us measured; with Megatron's layouts as baseline the two agree exactly)."""
    from layout_prop.perf.clusters import get_cluster

    report = plan_spec(load_spec(_auto_llama()), backward=False, objective="time", cluster=get_cluster("a100-80g"))
    assert report.solver["kept"] == "plan"
    assert report.solver["modelled_cost"] * 1e-6 == pytest.approx(report.plan["step_time_s"], rel=0.05)


def test_the_training_step_the_solver_models_is_close_to_what_estimate_measures():
    """With the backward, the solver's objective on a cluster against the estimate of the realised plan, within
    5%. Measured: 710.0 us modelled, 704.5 us measured (728.6 before the reshard pass stopped gathering x's
    cotangent twice; 686.8 against 728.6, 5.7%, before the model counted the adds that sum the cotangents of a
    value read several times)."""
    from layout_prop.perf.clusters import get_cluster

    report = plan_spec(load_spec(_auto_llama()), objective="time", cluster=get_cluster("a100-80g"))
    assert report.solver["kept"] == "plan"
    assert report.solver["modelled_cost"] * 1e-6 == pytest.approx(report.plan["step_time_s"], rel=0.05)
