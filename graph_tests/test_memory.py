"""The memory pass against the bytes the simulator really holds, and its report in check."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.core import meta
from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.engines import simulator as simulator_module
from layout_prop.engines.simulator import Simulator
from layout_prop.io.loader import load_spec
from layout_prop.frontends.generate import llama_spec
from layout_prop.passes.lower import Lower
from layout_prop.passes.memory import Memory
from layout_prop.runner import random_inputs


def _held(env, rank, skip):
    """Bytes rank ``rank`` holds in the simulator's environment, a buffer shared by views once."""
    by_owner = {}
    for value, arrays in env.items():
        if value in skip:
            continue
        a = arrays[rank]
        owner = a if a.base is None else a.base
        views, total = by_owner.get(id(owner), (owner.nbytes, 0))
        by_owner[id(owner)] = (views, total + a.nbytes)
    return sum(min(owner_bytes, views) for owner_bytes, views in by_owner.values())


def _simulate_and_measure(graph, monkeypatch):
    """Run the lowered program, measuring after every op the bytes each rank holds."""
    program = Lower().run(graph).program
    params = {n.name for n in graph.inputs() if n.attrs.get("requires_grad")}
    grads = {n.name for n in graph.nodes if n.meta.get(meta.GRAD_OF)}
    ranks = graph.mesh.size
    peaks = [0] * ranks
    param_bytes = [0] * ranks
    run_kernel, run_step, cut_input = Simulator._run_kernel, Simulator._run_step, simulator_module._cut_input

    def measure(env):
        for r in range(ranks):
            peaks[r] = max(peaks[r], _held(env, r, params | grads))

    def kernel(self, op, env, n):
        out = run_kernel(self, op, env, n)
        measure({**env, **out})
        return out

    def step(self, op, env, gives_up):
        run_step(self, op, env, gives_up)
        measure(env)

    def cut(op, *args):
        pieces = cut_input(op, *args)
        if op.name in params:
            for r in range(ranks):
                param_bytes[r] += pieces[r].nbytes
        return pieces

    monkeypatch.setattr(Simulator, "_run_kernel", kernel)
    monkeypatch.setattr(Simulator, "_run_step", step)
    monkeypatch.setattr(simulator_module, "_cut_input", cut)
    out = Simulator().execute(program, random_inputs(graph, 0), np.random.default_rng(1), wanted=list(graph.outputs))
    grad_bytes = [sum(out[g][r].nbytes for g in grads) for r in range(ranks)]
    return peaks, param_bytes, grad_bytes


@pytest.mark.parametrize("mesh", [(("dp", 2), ("sp", 2), ("tp", 2)), (("dp", 2), ("sp", 1), ("tp", 4))])
def test_estimate_matches_what_the_simulator_holds(mesh, monkeypatch):
    graph = analyze(load_spec(llama_spec(2, mesh, seq=16, hidden=64, ffn=128)), reshard=True, backward=True).graph
    report = Memory(optimizer="adam").run(graph)
    assert report.lowered and report.includes_backward
    peaks, param_bytes, grad_bytes = _simulate_and_measure(graph, monkeypatch)
    for r, est in enumerate(report.ranks):
        assert est.parameters == param_bytes[r]
        assert est.gradients == grad_bytes[r]
        assert est.optimizer_states == 2 * param_bytes[r]
        assert abs(est.activations - peaks[r]) <= 0.10 * peaks[r], (r, est.activations, peaks[r])


def test_uneven_shards_report_every_rank():
    spec = """
mesh: {shape: [4], names: [dp]}
inputs:
  x: {shape: [10, 8], placements: ["S(0)"], requires_grad: false}
  w: {shape: [8, 8]}
nodes:
  - {name: y, op: matmul, inputs: [x, w]}
"""
    report = Memory().run(analyze(load_spec(spec), reshard=True, backward=True).graph)
    data = report.to_dict()
    assert data["rank"] == 0 and data["parameters"] == 8 * 8 * 4 and data["optimizer_states"] == 0
    per_rank = {r["rank"]: r["activations"] for r in data["per_rank"]}
    assert per_rank[0] > per_rank[3]  # rows 3, 3, 3, 1: the last rank holds the least


def test_check_json_and_text_show_memory(tmp_path, capsys):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(llama_spec(1)))
    assert main(["check", str(path), "--reshard", "--backward", "--optimizer", "adam", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    mem = data["memory_per_rank"]
    assert mem["optimizer_states"] == 2 * mem["parameters"] > 0
    assert mem["total"] == mem["parameters"] + mem["gradients"] + mem["optimizer_states"] + mem["activations"]
    assert main(["check", str(path), "--reshard"]) == 0
    assert "memory per rank: " in capsys.readouterr().out


def test_bad_optimizer_is_unusable_input(tmp_path, capsys):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(llama_spec(1)))
    assert main(["check", str(path), "--optimizer", "lion"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_run_json_reports_the_memory_check_reports(tmp_path, capsys):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(llama_spec(1)))
    assert main(["check", str(path), "--reshard", "--backward", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)["memory_per_rank"]
    assert main(["run", str(path), "--backward", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)["memory_per_rank"]
    assert ran == checked and ran["includes_backward"] and ran["total"] > 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4), st.integers(0, 3)), max_size=40),
       st.lists(st.integers(0, 2 ** 40), min_size=4, max_size=4), st.booleans())
def test_peak_is_the_most_bytes_alive_at_one_op(values, nbytes, huge):
    """The vectorised peak (and the Python one, for totals past int64) against a count of the
    bytes alive at every op: a value made at op b and last used at op b + extra is alive at
    ops b..b + extra."""
    from layout_prop.passes.memory import _Walk

    if huge:
        nbytes = [n * 2 ** 40 for n in nbytes]  # past int64 once summed: the Python integers path
    values = sorted(values)
    walk = _Walk([], set(), [])
    walk.born = [b for b, _, _ in values]
    walk.last = [b + extra for b, extra, _ in values]
    walk.spec = [k for _, _, k in values]
    expected = max([sum(nbytes[k] for b, extra, k in values if b <= i <= b + extra) for i in range(12)] + [0])
    assert walk.peak(tuple(nbytes)) == expected


def test_integer_and_bool_inputs_take_no_gradient(tmp_path, capsys):
    """Token ids and masks are not parameters: by default they get no gradient, no memory for
    one and no collective for one (the default was true for every dtype: an int32 input got
    an integer gradient, all-gathered, and was counted twice in the memory)."""
    spec = ("mesh: {shape: [2], names: [tp]}\n"
            "inputs:\n"
            "  ids: {shape: [3, 4], dtype: int32}\n"
            "  w: {shape: [7, 8], placements: [S(1)]}\n"
            "  m: {shape: [3, 4, 8], dtype: int32}\n"
            "  keep: {shape: [3, 4, 8], dtype: bool}\n"
            "nodes:\n"
            "  - {name: e, op: embedding, inputs: [ids, w]}\n"
            "  - {name: y, op: mul, inputs: [e, m]}\n"
            "  - {name: z, op: mul, inputs: [y, keep]}\n")
    graph = load_spec(spec)
    assert {n.name: n.attrs["requires_grad"] for n in graph.inputs()} == {
        "ids": False, "w": True, "m": False, "keep": False}
    g = analyze(graph, reshard=True, backward=True).graph
    grads = {n.meta[meta.GRAD_OF] for n in g.nodes if meta.GRAD_OF in n.meta}
    assert grads == {"w"}
    report = Memory().run(g).max
    assert report.parameters == report.gradients == 7 * 8 * 4 // 2  # w's half on each rank, nothing else
    path = tmp_path / "emb.yaml"
    path.write_text(spec)
    assert main(["run", str(path), "--backward", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["ok"] is True and ran["executed"] is True
    assert sorted(ran["grads"]) == ["w"]
