"""Ring attention: ``scaled_dot_product_attention`` and ``flash_attention_score`` with
``context_parallel='ring'`` (ops/ring.py).

The reference of every numerical test here is the PLAIN attention on one device (the numpy
``scaled_dot_product_attention`` or ``flash_attention_score`` kernel and its gradient kernel
on the global arrays; for the Llama, the plain model's graph), not
the expanded graph: ``run`` and the testing kit compare the ranks with the expanded graph
executed on one device, which would not see a wrong expansion.  Hand counts: a block of k
is its local piece, ``(n - 1) x block bytes x 2`` the ring's bytes for k and v.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from layout_prop.api import analyze
from layout_prop.core import meta
from layout_prop.core.registry import get_rule
from layout_prop.engines.collectives import assemble
from layout_prop.engines.simulator import Simulator
from layout_prop.io.loader import load_spec
from layout_prop.kernels.attention_ring_numpy import (attention_block, attention_block_grad, attention_merge,
                                                      attention_merge_grad, ring_shift)
from layout_prop.kernels.nn_numpy import scaled_dot_product_attention, scaled_dot_product_attention_grad
from layout_prop.passes.lower import Lower
from layout_prop.runner import random_inputs, run_graph

from .cli_support import run_in_process


def _spec(mesh, names, q, k, v, placements, attrs, dtype="float32") -> dict:
    inputs = {name: {"shape": list(shape), "placements": list(placements[name] if isinstance(placements, dict)
                                                                else placements), "dtype": dtype}
              for name, shape in (("q", q), ("k", k), ("v", v))}
    return {"mesh": {"shape": list(mesh), "names": list(names)}, "inputs": inputs,
            "nodes": [{"name": "attn", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
                       "attrs": {"context_parallel": "ring", **attrs}}],
            "outputs": ["attn"]}


CP4 = _spec((4,), ("cp",), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), ["S(2)"], {"causal": True})
DP_CP = _spec((2, 2), ("dp", "cp"), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), ["S(0)", "S(2)"], {"causal": True})

CASES = {
    "cp4-causal": CP4,
    "cp4-full": _spec((4,), ("cp",), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), ["S(2)"], {"causal": False}),
    "dp2xcp2-causal": DP_CP,
    "dp2xcp2-full": _spec((2, 2), ("dp", "cp"), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), ["S(0)", "S(2)"],
                          {"causal": False}),
    # grouped-query heads (4 on 2), v's head size 3, on cp=4
    "cp4-gqa": _spec((4,), ("cp",), (1, 4, 8, 2), (1, 2, 8, 2), (1, 2, 8, 3), ["S(2)"], {"causal": True}),
    # BSND, a causal offset and an explicit scale, the heads on a second axis
    "bsnd-offset": _spec((4, 2), ("cp", "tp"), (2, 8, 2, 4), (2, 8, 2, 4), (2, 8, 2, 4), ["S(1)", "S(2)"],
                         {"causal": True, "layout": "BSND", "q_offset": 2, "scale": 0.3}),
    # query blocks of 1 row, key blocks of 2 (Sq 4, Skv 8)
    "cp4-cross": _spec((4,), ("cp",), (1, 2, 4, 4), (1, 2, 8, 4), (1, 2, 8, 4), ["S(2)"], {"causal": True}),
    # the load-balanced ring: the sequence stored in the zig-zag order of 8 chunks, rank i holding chunks i, 7 - i
    "cp4-zigzag": _spec((4,), ("cp",), (1, 2, 16, 2), (1, 2, 16, 2), (1, 2, 16, 2), ["S(2)"],
                        {"causal": True, "zigzag": 4}),
    "dp2xcp2-zigzag": _spec((2, 2), ("dp", "cp"), (2, 2, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), ["S(0)", "S(2)"],
                            {"causal": True, "zigzag": 2}),
}


def _plain_reference(spec: dict, inputs: dict, cotangent: np.ndarray):
    attrs = {k: v for k, v in spec["nodes"][0]["attrs"].items() if k != "context_parallel"}
    q, k, v = (inputs[n] for n in "qkv")
    out = scaled_dot_product_attention(q, k, v, **attrs)
    dq, dk, dv = scaled_dot_product_attention_grad(cotangent, q, k, v, **attrs)
    return {"attn": out, "grad/q": dq, "grad/k": dk, "grad/v": dv}


def _run_ring(spec: dict, seed: int = 0):
    """The expanded graph, its per-rank results assembled, and the plain one-device reference."""
    analysis = analyze(load_spec(spec), reshard=True, backward=True, verify=True)
    assert analysis.ok, [str(v) for v in analysis.check.violations]
    g = analysis.graph
    program = Lower().run(g).program
    inputs = random_inputs(g, seed)
    local = Simulator().execute(program, inputs, np.random.default_rng(seed), wanted=list(g.outputs))
    got = {}
    for value in g.outputs:
        node, index = g.producer(value)
        got[value] = assemble(local[value], node.meta[meta.SPECS][index])
    return g, program, got, _plain_reference(spec, inputs, inputs["cotangent/attn"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_ring_forward_and_backward_equal_plain_attention_on_one_device(case):
    spec = yaml.safe_load(yaml.safe_dump(CASES[case]))
    spec["inputs"] = {n: {**e, "dtype": "float64"} for n, e in spec["inputs"].items()}
    g, program, got, ref = _run_ring(spec)
    ops = [n.op for n in g.nodes]
    assert "ring_shift" in ops and "scaled_dot_product_attention" not in ops
    kinds = {op.op for op in program.collectives}
    assert "permute" in kinds and "all-gather" not in kinds, kinds
    assert sorted(got) == sorted(ref)
    for value, want in ref.items():
        assert got[value].shape == want.shape, value
        np.testing.assert_allclose(got[value], want, rtol=1e-10, atol=1e-12, err_msg=value)


def test_ring_in_float32_within_the_float32_tolerance():
    g, _, got, ref = _run_ring(CASES["cp4-causal"], seed=3)
    for value, want in ref.items():
        np.testing.assert_allclose(got[value], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=value)


def test_ring_steps_per_rank_hold_one_block_of_k():
    """No rank's program holds more than one block of k or v: every k/v value in it has the local shape of a block."""
    g, program, _, _ = _run_ring(CP4)
    for op in program.ops:
        if op.source.startswith("attn/k_shift") or op.source.startswith("attn/v_shift"):
            assert [list(s.local_shape(1)) for s in op.specs] == [[2, 2, 2, 4]]


@pytest.mark.parametrize("placements", [["_S(2,2)", "S(2)"], ["S(2)", "_S(2,2)"]], ids=["strided-outer", "strided-inner"])
def test_ring_on_a_sequence_also_cut_by_a_strided_shard_equals_plain_attention(placements):
    """q, k, v's sequence cut by a strided shard on one axis and a shard on the other: the ring's
    shifts read k and v with the strided axis gathered (apply_rule's move), so their permute is
    of those pieces.  The expand pass priced the shift on the raw strided spec and raised
    bad-permute (check --reshard and run stopped with an error)."""
    spec = _spec((2, 2), ("a", "cp"), (1, 1, 8, 2), (1, 1, 8, 2), (1, 1, 8, 2), placements, {"causal": True},
                 dtype="float64")
    g, program, got, ref = _run_ring(spec)
    assert "ring_shift" in [n.op for n in g.nodes]
    for value, want in ref.items():
        np.testing.assert_allclose(got[value], want, rtol=1e-10, atol=1e-12, err_msg=value)


def _cli(*args, spec: dict, tmp_path, name="ring.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return run_in_process([*args, str(path)])


@pytest.mark.parametrize("case", ["cp4-causal", "cp4-full", "dp2xcp2-causal", "dp2xcp2-full"])
def test_run_backward_on_the_command_line(case, tmp_path):
    res = _cli("run", "--backward", spec=CASES[case], tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "matches one device" in res.stdout
    assert "permute on cp" in res.stdout and "all-gather" not in res.stdout
    for name in ("output attn", "grad q", "grad k", "grad v"):
        assert name in res.stdout


@pytest.mark.parametrize("case, block_bytes, n", [("cp4-causal", 2 * 2 * 2 * 4 * 4, 4),
                                                   ("dp2xcp2-causal", 1 * 2 * 4 * 4 * 4, 2)])
def test_check_reshard_json_lists_the_ring_permutes(case, block_bytes, n, tmp_path):
    res = _cli("check", "--reshard", "--json", spec=CASES[case], tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    moves = report["redistributions"]
    steps = [step for move in moves for step in move["steps"]]
    assert len(steps) == 2 * (n - 1)
    assert all(s["kind"] == "permute" and s["mesh_axis"] == "cp" and s["shift"] == 1 and s["cyclic"] for s in steps)
    assert not any(s["kind"] == "all-gather" for s in steps)
    assert [m["input"] for m in moves if m["node"].endswith("k_shift1")] == ["k"]
    assert all(s["bytes_per_rank"] == block_bytes for s in steps)
    assert sum(m["bytes_per_rank"] for m in moves) == (n - 1) * block_bytes * 2  # k and v


def test_lower_rank_shows_the_ring_permutes(tmp_path):
    res = _cli("lower", "--rank", "1", spec=CP4, tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if "permute on cp" in line]
    assert len(lines) == 6  # 3 steps for k and for v
    assert all("shift 1 cyclic: recv from 0, send to 2" in line for line in lines)
    assert all("128 bytes" in line for line in lines)
    back = _cli("lower", "--rank", "1", "--backward", spec=CP4, tmp_path=tmp_path)
    lines = [line for line in back.stdout.splitlines() if "permute on cp" in line]
    assert len(lines) == 12  # the gradients of k and v shifted back: shift -1
    assert sum("shift -1 cyclic: recv from 2, send to 0" in line for line in lines) == 6
    assert "all-gather" not in back.stdout


def test_estimate_prices_the_ring_as_its_permutes(tmp_path):
    res = _cli("estimate", "--cluster", "a100-80g", "--json", spec=CP4, tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    comm = json.loads(res.stdout)["breakdown"]["communication_exposed_s"]
    # a100-80g: NVLink 300 GB/s each way at link efficiency 0.8, 3 us a hop; a permute is one hop of one block.
    # forward: 3 steps x (k, v); backward: their gradients shifted back, 3 x 2 more
    one = 128 / (300e9 * 0.8) + 3e-6
    assert comm == {"cp": {"permute": pytest.approx(12 * one, rel=1e-12)}}


def test_ring_that_does_not_apply_says_so_and_gathers(tmp_path):
    # q, k, v sharded on both axes: the ring runs on one
    spec = _spec((2, 2), ("a", "b"), (1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), ["S(2)", "S(2)"], {"causal": True})
    res = _cli("check", "--reshard", spec=spec, tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "context_parallel='ring') gathers k and v instead: q's sequence (dim 2) is sharded on 2 mesh axes" \
        in res.stdout
    assert "all-gather" in res.stdout and "permute" not in res.stdout
    rep = run_graph(load_spec(spec), backward=True)
    assert rep.ok
    # v sharded on the heads: not like q
    odd = _spec((4,), ("cp",), (1, 4, 8, 4), (1, 4, 8, 4), (1, 4, 8, 4), {"q": ["S(2)"], "k": ["S(2)"], "v": ["S(1)"]},
                {"causal": True})
    res = _cli("check", "--reshard", spec=odd, tmp_path=tmp_path)
    assert "v's sequence is not sharded on mesh axis 'cp' alone like q's (v is (S(1))" in res.stdout
    assert "permute" not in res.stdout


def test_without_reshard_the_ring_is_a_fixable_gather_whose_hint_names_the_ring():
    from layout_prop import DeviceMesh, Layout, TensorSpec

    mesh = DeviceMesh((2,), ("cp",))
    for op, shape, attrs in (("flash_attention_score", (2, 8, 16), {"head_num": 4}),
                             ("scaled_dot_product_attention", (2, 2, 8, 4), {})):
        seq = 1 if len(shape) == 3 else 2
        q = TensorSpec(shape, "float32", Layout(mesh, [f"S({seq})"], len(shape)))
        rule = get_rule(op)
        res = rule.infer_layout((q, q, q), rule.normalize_attrs({**attrs, "context_parallel": "ring"}))
        assert [(v.code, v.fixable) for v in res.violations] == [("sharded-kv-sequence", True)] * 2, op
        assert all("--reshard passes k and v around the ring" in v.hint for v in res.violations), op
        bad = rule.infer_layout((q, q, q), rule.normalize_attrs({**attrs, "context_parallel": "rings"}))
        assert [v.code for v in bad.violations] == ["invalid-attr"], op


# ------------------------------------------------------------------------------ the ops themselves
def test_ring_shift_kernel_and_its_permute_agree():
    assert ring_shift(np.arange(8), dim=0, blocks=4).tolist() == [6, 7, 0, 1, 2, 3, 4, 5]
    assert ring_shift(np.arange(8), dim=0, blocks=4, shift=-1).tolist() == [2, 3, 4, 5, 6, 7, 0, 1]
    spec = {"mesh": {"shape": [4], "names": ["cp"]}, "inputs": {"x": {"shape": [3, 8], "placements": ["S(1)"]}},
            "nodes": [{"name": "y", "op": "ring_shift", "inputs": ["x"], "attrs": {"dim": 1, "blocks": 4}}],
            "outputs": ["y"]}
    rep = run_graph(load_spec(spec), backward=True)
    assert rep.ok and [c["kind"] for c in rep.collectives] == ["permute", "permute"]


def test_ring_shift_on_an_axis_of_another_size_is_a_fixable_mismatch():
    from layout_prop import DeviceMesh, Layout, TensorSpec

    mesh = DeviceMesh((2, 2), ("a", "b"))
    x = TensorSpec((3, 8), "float32", Layout(mesh, ["S(1)", "R"], 2))
    rule = get_rule("ring_shift")
    res = rule.infer_layout((x,), rule.normalize_attrs({"dim": 1, "blocks": 4}))
    assert [(v.code, v.fixable) for v in res.violations] == [("sharding-mismatch", True)]
    assert str(res.wants[0]) == "(R, R)"


def test_ring_shift_passes_a_partial_sum_through_and_declares_no_partial_input():
    """ring_shift is linear: a Partial x is shifted as it is, so partial-input is not among its codes
    (docs/ops.md listed it)."""
    from layout_prop import DeviceMesh, Layout, TensorSpec

    x = TensorSpec((3, 8), "float32", Layout(DeviceMesh((4,), ("cp",)), ["P(sum)"], 2))
    rule = get_rule("ring_shift")
    res = rule.infer_layout((x,), rule.normalize_attrs({"dim": 1, "blocks": 4}))
    assert res.violations == () and str(res.outputs[0].layout) == "(P(sum))"
    assert "partial-input" not in rule.violation_codes


def test_attention_block_calls_k_sharded_unlike_q_a_sharding_mismatch_and_declares_what_it_gives():
    """A block's k and v are sharded like q, never gathered: k sharded on the sequence where q is not is
    sharding-mismatch (docs/ops.md listed sharded-kv-sequence, which the block never gives, and
    broadcast-shape, which only the grad's cotangent gives)."""
    from layout_prop import DeviceMesh, Layout, TensorSpec

    mesh = DeviceMesh((4,), ("cp",))
    q = TensorSpec((1, 2, 8, 4), "float32", Layout(mesh, ["R"], 4))
    k = TensorSpec((1, 2, 8, 4), "float32", Layout(mesh, ["S(2)"], 4))
    rule = get_rule("attention_block")
    res = rule.infer_layout((q, k, k), rule.normalize_attrs({"blocks": 4}))
    assert [(v.code, v.fixable) for v in res.violations] == [("sharding-mismatch", True)] * 2
    assert "sharded-kv-sequence" not in rule.violation_codes and "broadcast-shape" not in rule.violation_codes
    grad = get_rule("attention_block_grad")
    assert "sharded-kv-sequence" not in grad.violation_codes and "broadcast-shape" in grad.violation_codes


def test_a_sequence_cut_by_a_strided_shard_alone_gathers_and_the_note_says_so():
    spec = _spec((2,), ("cp",), (1, 1, 8, 2), (1, 1, 8, 2), (1, 1, 8, 2), ["_S(2,2)"], {"causal": True},
                 dtype="float64")
    analysis = analyze(load_spec(spec), reshard=True, backward=True)
    assert analysis.ok and "ring_shift" not in {n.op for n in analysis.graph.nodes}
    assert any("gathers k and v instead: q's sequence (dim 2) is cut by strided shards only (q is (_S(2,2)))"
               in note for note in analysis.notes), analysis.notes  # it said "sharded on 0 mesh axes"
    assert run_graph(load_spec(spec), backward=True).ok


def test_the_ring_permute_is_planned_once_per_spec(monkeypatch):
    """permute_step checks every rank's piece; the expand, check, memory and lower passes each asked
    it for every shift, so a ring on n ranks cost O(n^2) (check --reshard on cp=1024: 15.5 s, cp=4096
    over 300 s; now 0.7 s and 9.7 s).  One spec of k (and v alike) gives one permute."""
    import layout_prop.ops.ring as ring

    calls = []
    real = ring.permute_step
    monkeypatch.setattr(ring, "permute_step", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    if hasattr(ring, "_ring_permute"):
        ring._ring_permute.cache_clear()  # planned afresh here
    spec = _spec((16,), ("cp",), (1, 1, 32, 4), (1, 1, 32, 4), (1, 1, 32, 4), ["S(2)"], {"causal": True})
    analysis = analyze(load_spec(spec), reshard=True)
    assert analysis.ok and analysis.check.total_bytes_per_rank == 15 * 2 * (2 * 4 * 4)  # 15 shifts of k, v
    analysis.memory()
    Lower().run(analysis.graph)
    assert len(calls) == 1  # k and v have one spec


def test_blocks_that_see_no_key_merge_to_nothing():
    q = np.ones((1, 1, 2, 2))
    # step 1 of 2 blocks, causal: query block 0 holds original key block 1 (the future): no key, lse -inf
    packed = attention_block(q, q, q, blocks=2, step=1, causal=True)
    assert packed[0, 0, 0].tolist() == [0.0, 0.0, -np.inf]
    assert np.isfinite(packed[0, 0, 1]).all()
    empty = packed[:, :, :1]
    merged = attention_merge(empty, empty)
    assert merged[0, 0, 0].tolist() == [0.0, 0.0, -np.inf]
    da, db = attention_merge_grad(np.ones_like(empty), empty, empty)
    assert not da.any() and not db.any()
    dq, dk, dv = attention_block_grad(np.ones_like(packed), q, q, q, blocks=2, step=1, causal=True)
    assert np.isfinite(dq).all() and not dq[0, 0, 0].any()


def _numeric_grad(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        old = x[index]
        x[index] = old + eps
        up = f()
        x[index] = old - eps
        down = f()
        x[index] = old
        grad[index] = (up - down) / (2 * eps)
    return grad


def test_block_and_merge_gradients_against_finite_differences():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 2, 4, 3)), rng.normal(size=(1, 1, 4, 3)), rng.normal(size=(1, 1, 4, 2))
    attrs = {"blocks": 2, "step": 1, "causal": True, "q_offset": 2}
    dy = rng.normal(size=(1, 2, 4, 3))  # the last column: the cotangent of the log-sum-exp

    def loss():
        return float(np.sum(attention_block(q, k, v, **attrs) * dy))

    grads = attention_block_grad(dy, q, k, v, **attrs)
    for got, x in zip(grads, (q, k, v)):
        np.testing.assert_allclose(got, _numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    a, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))
    dy = rng.normal(size=(2, 3, 4))

    def merged():
        return float(np.sum(attention_merge(a, b) * dy))

    for got, x in zip(attention_merge_grad(dy, a, b), (a, b)):
        np.testing.assert_allclose(got, _numeric_grad(merged, x), rtol=1e-6, atol=1e-8)


def test_the_packed_result_of_one_block_is_plain_attention_and_its_lse():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(1, 2, 4, 3)) for _ in range(3))
    packed = attention_block(q, k, v, blocks=1, causal=True)
    np.testing.assert_allclose(packed[..., :3], scaled_dot_product_attention(q, k, v, causal=True), rtol=1e-12)
    scores = np.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(3)
    row = 2  # sees keys 0..2
    np.testing.assert_allclose(packed[0, 1, row, 3], np.log(np.exp(scores[0, 1, row, :3]).sum()), rtol=1e-12)


# ------------------------------------------------------------------------------ a Llama training graph
def test_gen_llama_full_with_a_ring_equals_the_plain_llama(tmp_path):
    """gen llama --full --context-parallel ring runs (the CLI) and, on one device, its expanded graph
    gives the plain Llama's loss and gradients on the same inputs (the expansion checked in a model:
    rotary positions, grouped-query heads, the causal offsets of sp=2)."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.runner import execute_global

    res = run_in_process(["gen", "llama", "--full", "--kv-heads", "2", "--layers", "2", "--context-parallel", "ring",
                          "-o", str(tmp_path / "l.yaml")])
    assert res.returncode == 0, res.stderr
    run = run_in_process(["run", "--backward", str(tmp_path / "l.yaml")])
    assert run.returncode == 0 and "matches one device" in run.stdout, run.stderr + run.stdout
    permutes = [line for line in run.stdout.splitlines() if "collective permute on sp" in line]
    assert len(permutes) == 2 * 2 * 2  # 2 layers, k and v, forward and backward, one step each on sp=2
    assert "all-gather on sp for l0_k" not in run.stdout

    graphs = {}
    for cp in ("ring", "all_gather"):
        spec = llama_spec(2, kv_heads=2, full=True, dtype="float64", context_parallel=cp)
        graphs[cp] = analyze(load_spec(spec), reshard=True, backward=True).graph
    assert "attention_block" in {n.op for n in graphs["ring"].nodes}
    assert "attention_block" not in {n.op for n in graphs["all_gather"].nodes}
    inputs = random_inputs(graphs["all_gather"], 5)
    assert sorted(random_inputs(graphs["ring"], 5)) == sorted(inputs)
    ring = execute_global(graphs["ring"], inputs, wanted=list(graphs["ring"].outputs))
    plain = execute_global(graphs["all_gather"], inputs, wanted=list(graphs["all_gather"].outputs))
    assert sorted(ring) == sorted(plain) and len(plain) > 10
    for value in plain:
        np.testing.assert_allclose(ring[value], plain[value], rtol=1e-9, atol=1e-12, err_msg=value)


# ------------------------------------------------------------------------------ MindSpore kernels
def test_mindspore_kernels_match_numpy():
    pytest.importorskip("mindspore")
    from layout_prop.kernels.mindspore_backend import KERNELS as MS, to_numpy
    from layout_prop.kernels.numpy_backend import KERNELS as NP

    rng = np.random.default_rng(0)
    f = np.float32
    q, k, v = (rng.normal(size=s).astype(f) for s in ((2, 4, 8, 3), (2, 2, 8, 3), (2, 2, 8, 2)))

    def same(op, *args, **attrs):
        want, got = NP[op](*args, **attrs), MS[op](*args, **attrs)
        want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
        for w, g in zip(want, got):
            g = to_numpy(g)
            assert g.shape == w.shape and g.dtype == w.dtype, op
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=op)

    same("ring_shift", q, dim=2, blocks=4, shift=-1)
    same("attention_block", q, k, v, blocks=4, step=1, causal=True, zigzag=2)
    for step in range(4):  # steps 1-3 hold rows that see no key (lse -inf)
        same("attention_block", q, k, v, blocks=4, step=step, causal=True, q_offset=1)
        same("attention_block_grad", rng.normal(size=(2, 4, 8, 3)).astype(f), q, k, v, blocks=4, step=step,
             causal=True)
    a = NP["attention_block"](q, k, v, blocks=4, step=1, causal=True)
    b = NP["attention_block"](q, k, v, blocks=4, step=2, causal=True)
    assert np.isneginf(a[..., -1]).any() and np.isneginf(b[..., -1]).any()
    same("attention_merge", a, b)
    same("attention_merge_grad", rng.normal(size=a.shape).astype(f), a, b)


def test_memory_per_rank_of_the_ring_against_the_gather():
    """Measured by the memory pass (q, k, v (1, 8, 4096, 64) float16 on cp=4, causal; a block of k is 1 MiB):
    forward, the ring's activation peak is 5,292,032 bytes against the gather's 9,437,184 (which holds
    k and v whole, 8 MiB); with the backward the expanded graph keeps every step's shifted k and v block
    for the gradient, so the saving shrinks (16,924,672 against 19,922,944)."""
    peaks = {}
    for cp in ("all_gather", "ring"):
        for backward in (False, True):
            spec = _spec((4,), ("cp",), (1, 8, 4096, 64), (1, 8, 4096, 64), (1, 8, 4096, 64), ["S(2)"],
                         {"causal": True}, dtype="float16")
            spec["nodes"][0]["attrs"]["context_parallel"] = cp
            memory = analyze(load_spec(spec), reshard=True, backward=backward).memory().to_dict()
            peaks[cp, backward] = memory["activations"]
    block = 1 * 8 * 1024 * 64 * 2  # one rank's block of k (or v, q, the output), float16
    packed = 1 * 8 * 1024 * 65 * 2  # one block's output packed with its log-sum-exp
    assert peaks["all_gather", False] == 4 * block * 2 + block  # k and v gathered, and the output
    # the ring: at most the pair of k, v blocks in use and the next pair arriving, and two packed results
    assert 4 * block <= peaks["ring", False] <= 4 * block + 2 * packed
    assert peaks["ring", True] >= 6 * block  # the backward keeps the 3 shifted blocks of k and of v
    assert peaks["ring", True] < peaks["all_gather", True]


# ------------------------------------------------------------------------------ flash_attention_score
def _fa_spec(mesh, names, q, kv, placements, attrs) -> dict:
    inputs = {name: {"shape": list(shape), "placements": list(placements), "dtype": "float64"}
              for name, shape in (("query", q), ("key", kv), ("value", kv))}
    return {"mesh": {"shape": list(mesh), "names": list(names)}, "inputs": inputs,
            "nodes": [{"name": "attn", "op": "flash_attention_score", "inputs": ["query", "key", "value"],
                       "attrs": {"context_parallel": "ring", **attrs}}],
            "outputs": ["attn"]}


FA_CASES = {
    # BSH, 4 query heads on 2 kv heads of 4, top-left causal, MindSpore's explicit scale
    "bsh-gqa-causal": _fa_spec((4,), ("cp",), (2, 8, 16), (2, 8, 8), ["S(1)"],
                               {"head_num": 4, "sparse_mode": 2, "scale": 0.5}),
    # SBH on dp x cp, no mask
    "sbh-dp-cp": _fa_spec((2, 2), ("dp", "cp"), (8, 2, 8), (8, 2, 8), ["S(1)", "S(0)"], {"head_num": 2}),
    # BNSD, bottom-right causal with 4 queries on 8 keys (an offset of 4)
    "bnsd-bottom-right": _fa_spec((4,), ("cp",), (1, 2, 4, 4), (1, 2, 8, 4), ["S(2)"],
                                  {"head_num": 2, "input_layout": "BNSD", "sparse_mode": 3}),
    # BSND in the zig-zag order
    "bsnd-zigzag": _fa_spec((4,), ("cp",), (1, 16, 2, 2), (1, 16, 2, 2), ["S(1)"],
                            {"head_num": 2, "input_layout": "BSND", "sparse_mode": 2, "zigzag": 4}),
    # BSH with the heads on tp (whole heads) and the sequence on cp
    "bsh-cp-tp": _fa_spec((2, 2), ("cp", "tp"), (2, 8, 16), (2, 8, 16), ["S(1)", "S(2)"],
                          {"head_num": 4, "sparse_mode": 2}),
}


@pytest.mark.parametrize("case", sorted(FA_CASES))
def test_flash_attention_ring_equals_plain_flash_attention_on_one_device(case):
    from layout_prop.kernels.attention_numpy import flash_attention_score, flash_attention_score_grad

    spec = FA_CASES[case]
    analysis = analyze(load_spec(spec), reshard=True, backward=True, verify=True)
    assert analysis.ok, [str(v) for v in analysis.check.violations]
    g = analysis.graph
    assert "ring_shift" in {n.op for n in g.nodes} and "flash_attention_score" not in {n.op for n in g.nodes}
    program = Lower().run(g).program
    assert {op.op for op in program.collectives} <= {"permute", "all-reduce", "reduce-scatter"}
    inputs = random_inputs(g, 2)
    local = Simulator().execute(program, inputs, np.random.default_rng(2), wanted=list(g.outputs))
    attrs = {k: v for k, v in spec["nodes"][0]["attrs"].items() if k != "context_parallel"}
    q, k, v = (inputs[n] for n in ("query", "key", "value"))
    dq, dk, dv = flash_attention_score_grad(inputs["cotangent/attn"], q, k, v, **attrs)
    ref = {"attn": flash_attention_score(q, k, v, **attrs), "grad/query": dq, "grad/key": dk, "grad/value": dv}
    for value, want in ref.items():
        node, index = g.producer(value)
        got = assemble(local[value], node.meta[meta.SPECS][index])
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=value)


@pytest.mark.parametrize("attrs, why", [
    ({"head_num": 2, "sparse_mode": 4, "pre_tokens": 1, "next_tokens": 0}, "sparse_mode=4"),
    ({"head_num": 2, "keep_prob": 0.5}, "keep_prob=0.5"),
    ({"head_num": 2, "pre_tokens": 2}, "sparse_mode=0 with a band"),
])
def test_flash_attention_ring_that_does_not_apply_gathers_and_says_why(attrs, why):
    spec = _fa_spec((4,), ("cp",), (1, 8, 8), (1, 8, 8), ["S(1)"], attrs)
    analysis = analyze(load_spec(spec), reshard=True, backward=True)
    assert analysis.ok
    assert any("context_parallel='ring') gathers key and value instead: " + why in note for note in analysis.notes)
    assert "ring_shift" not in {n.op for n in analysis.graph.nodes}
    assert run_graph(load_spec(spec), backward=True).ok


# ------------------------------------------------------------------------------ the whole-graph plan and the ring
def _projected(x_placements, w_placements, out_projection: bool = False) -> dict:
    """q, k and v projected from x (2, 8, 8) float32 on dp=2 x cp=2 by three linears (weights ``w_placements``,
    or ``auto``) and split into 2 heads (BSND), then ring attention on cp: 7 ops, 12 once the ring is written,
    so ``analyze`` also asks the whole-graph solver where to redistribute; ``out_projection``: a reshape and a
    linear after the attention."""
    inputs = {"x": {"shape": [2, 8, 8], "placements": list(x_placements)}}
    nodes = []
    for t in "qkv":
        inputs[f"w{t}"] = {"shape": [8, 8], "placements": w_placements}
        nodes += [{"name": f"{t}0", "op": "linear", "inputs": ["x", f"w{t}"]},
                  {"name": t, "op": "reshape", "inputs": [f"{t}0"], "attrs": {"shape": [2, 8, 2, 4]}}]
    nodes.append({"name": "attn", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
                  "attrs": {"layout": "BSND", "causal": True, "context_parallel": "ring"}})
    outputs = ["attn"]
    if out_projection:
        inputs["wo"] = {"shape": [8, 8], "placements": w_placements}
        nodes += [{"name": "m", "op": "reshape", "inputs": ["attn"], "attrs": {"shape": [2, 8, 8]}},
                  {"name": "o", "op": "linear", "inputs": ["m", "wo"]}]
        outputs = ["o"]
    return {"mesh": {"shape": [2, 2], "names": ["dp", "cp"]}, "inputs": inputs, "nodes": nodes, "outputs": outputs}


#: what the solver's cheapest plan does with the ring of _projected: x gathered whole before the projections,
#: q, k and v sliced on the heads, so the attention runs on the whole sequence and the shifts are local rolls
DROPPED = ("the whole-graph plan of {plan} bytes per rank does not run attn (scaled_dot_product_attention) as the "
           "expand pass wrote it, which context_parallel='ring' on mesh axis 'cp' asks: its nodes read q, k, v as "
           "{now}, not (S(0), S(1)); attn/k_shift1, attn/v_shift1 (ring_shift) move nothing; not taken: ")


def _ring_moves(analysis) -> list[tuple[str, str, list[str], int]]:
    return [(r.input, r.node, [s.kind for s in r.plan.steps], r.plan.bytes_per_rank)
            for r in analysis.check.redistributions if r.node in ("attn/k_shift1", "attn/v_shift1")]


def _analysed_and_run(spec: dict, monkeypatch, backward: bool = False):
    """``run_graph`` of ``spec`` with the verifier after every pass, and the analysis it ran first: the one
    ``analyze(load_spec(spec), reshard=True, backward=backward, verify=True)`` gives.  One analysis where a
    test made the same one twice (its own, then run_graph's): on these graphs the whole-graph solver's notes
    cost seconds of CPU an analysis."""
    import layout_prop.api as api

    real, analyses = api.analyze, []

    def analysed(*args, **kwargs):
        analyses.append(real(*args, **kwargs))
        return analyses[-1]

    with monkeypatch.context() as patch:
        patch.setattr(api, "analyze", analysed)
        report = run_graph(load_spec(spec), backward=backward, verify=True)
    return analyses[0], report


def test_a_whole_graph_plan_that_drops_the_ring_is_not_taken_and_the_note_says_so(monkeypatch):
    """The solver's plan moves 512 bytes per rank against the greedy sweep's 1664 by gathering x before the
    projections: no sequence shard reaches the attention.  It was taken, and the notes said the ring was
    written (the shifts then moved nothing).  The ring is asked for: the sweep's graph is kept, the note says
    why.  Hand count of the ring: a block of k is (2, 8, 2, 4) float32 / 4 ranks = 128 bytes, one shift each
    of k and v on cp=2."""
    pytest.importorskip("scipy")
    spec = _projected(["S(0)", "S(1)"], ["S(0)", "R"])
    analysis, run = _analysed_and_run(spec, monkeypatch, backward=True)
    assert analysis.ok
    notes = [n for n in analysis.notes if n.startswith("reshard:")]
    assert notes == ["reshard: " + DROPPED.format(plan=512, now="(S(2), R)")
                     + "the greedy sweep's 1664 bytes per rank run it as written"]
    assert _ring_moves(analysis) == [("k", "attn/k_shift1", ["permute"], 128), ("v", "attn/v_shift1", ["permute"], 128)]
    assert analysis.check.total_bytes_per_rank == 1664
    assert not any(n.startswith("expand: attn (scaled_dot_product_attention) does not run") for n in analysis.notes)
    assert run.ok


def test_when_the_plan_drops_the_ring_its_best_plan_that_keeps_it_is_taken_if_cheaper(monkeypatch):
    """With auto weights and an output projection the solver's plan (1152 bytes) drops the ring; its best plan
    with the ring's nodes held as written moves 2048, fewer than the greedy sweep's 2432: that one is taken."""
    pytest.importorskip("scipy")
    spec = _projected(["S(0)", "S(1)"], "auto", out_projection=True)
    analysis, run = _analysed_and_run(spec, monkeypatch, backward=True)
    assert analysis.ok
    notes = [n for n in analysis.notes if n.startswith("reshard:")]
    assert notes == ["reshard: " + DROPPED.format(plan=1152, now="(R, S(2))")
                     + "the solver's best plan that runs it as written moves 2048",
                     "reshard: chose where to redistribute over the whole graph: 2048 bytes per rank (the greedy "
                     "sweep moves 2432)"]
    assert _ring_moves(analysis) == [("k", "attn/k_shift1", ["permute"], 128), ("v", "attn/v_shift1", ["permute"], 128)]
    assert analysis.check.total_bytes_per_rank == 2048
    assert run.ok


def test_a_whole_graph_plan_that_changes_another_axis_keeps_the_ring_and_is_taken(monkeypatch):
    """Forward only, the plan gathers x's batch on dp and shards the heads there instead (q, k, v (S(2), S(1)),
    written (S(0), S(1))), the sequence still on cp: the ring runs as written (a layout changed on another axis
    keeps it), and the plan (384 bytes against 640) is taken without a word on the ring."""
    pytest.importorskip("scipy")
    spec = _projected(["S(0)", "S(1)"], ["S(0)", "R"])
    analysis, run = _analysed_and_run(spec, monkeypatch)
    assert analysis.tensors()["k"]["placements"] == ["S(2)", "S(1)"]
    assert [n for n in analysis.notes if n.startswith("reshard:")] == [
        "reshard: chose where to redistribute over the whole graph: 384 bytes per rank (the greedy sweep moves 640)"]
    assert _ring_moves(analysis) == [("k", "attn/k_shift1", ["permute"], 128), ("v", "attn/v_shift1", ["permute"], 128)]
    assert run.ok


def test_a_final_graph_that_does_not_run_the_ring_says_so_in_the_notes_run_prints(monkeypatch):
    """Where the moves finally chosen do not run the ring (here: the solver's plan taken whatever it does, as
    when the greedy sweep's graph does not check), an ``expand:`` note takes back the expand pass's own."""
    pytest.importorskip("scipy")
    import layout_prop.planner.choice as choice
    from layout_prop.passes.check import Check

    def take_the_plan(forward, plan, chosen, forced, greedy, check, ctx):
        planned = choice._planned(forward, plan.strategies(chosen), ctx)
        return planned, Check().run(planned), []

    monkeypatch.setattr(choice, "_whole_graph", take_the_plan)
    spec = _projected(["S(0)", "S(1)"], ["S(0)", "R"])
    said = ("expand: attn (scaled_dot_product_attention) does not run as written, which context_parallel='ring' on "
            "mesh axis 'cp' asks: in the resharded graph its nodes read q, k, v as (S(2), R), not (S(0), S(1)); "
            "attn/k_shift1, attn/v_shift1 (ring_shift) move nothing")
    analysis = analyze(load_spec(spec), reshard=True, backward=True)
    assert _ring_moves(analysis) == [] and said in analysis.notes
    assert said in run_graph(load_spec(spec), backward=True).notes


# ------------------------------------------------------------------------------ an auto input beside the ring
def _auto_beside_ring(autos=("k",), extra: str | None = None) -> dict:
    """q, k, v (2, 8, 2, 4) BSND on dp=2 x cp=2, batch on dp and sequence on cp, ``autos`` left ``auto``, one
    causal ring attention; ``extra``: k also added to an input r (R, S(2)) (``kk``), another use of k."""
    spec = _spec((2, 2), ("dp", "cp"), (2, 8, 2, 4), (2, 8, 2, 4), (2, 8, 2, 4), ["S(0)", "S(1)"],
                 {"causal": True, "layout": "BSND"})
    for name in autos:
        spec["inputs"][name]["placements"] = "auto"
    if extra:
        spec["inputs"]["r"] = {"shape": [2, 8, 2, 4], "placements": ["R", "S(2)"], "dtype": "float32"}
        spec["nodes"].append({"name": "kk", "op": "add", "inputs": ["k", "r"]})
        spec["outputs"] = ["attn", "kk"]
    return spec


def test_an_auto_key_beside_a_ring_is_cut_like_the_query_and_the_ring_runs():
    """k auto: complete tried (R, R) and the rule's want (S(0), R) only, and took (S(0), R), which gathers v
    (128 bytes) instead of the ring (a shift each of k and v: 256), so the expand note said the ring was not
    written.  The ring's layout, k cut like q, is now a candidate, and a candidate that drops the ring the
    attrs ask loses to one that runs it."""
    spec = _auto_beside_ring()
    analysis = analyze(load_spec(spec), reshard=True, backward=True, verify=True)
    assert analysis.ok
    assert analysis.tensors()["k"]["placements"] == ["S(0)", "S(1)"]
    assert _ring_moves(analysis) == [("k", "attn/k_shift1", ["permute"], 128), ("v", "attn/v_shift1", ["permute"], 128)]
    ring = "the ring attn asks (context_parallel='ring')"
    assert (f"auto layout of 'k': (S(0), S(1)) with 256 bytes/rank of redistribution, runs {ring}; alternatives: "
            f"(S(0), R): 128 bytes/rank, 1 violation(s), drops {ring}; (R, R): 128 bytes/rank, 1 violation(s), "
            f"drops {ring}") in analysis.notes
    assert not any("gathers k and v instead" in note for note in analysis.notes)
    assert run_graph(load_spec(spec), backward=True).ok


@pytest.mark.parametrize("autos", [("k", "v"), ("q",)], ids=["k-and-v", "q"])
def test_other_auto_operands_of_a_ring_reach_it(autos):
    """k and v both auto (completed one at a time, v tried alike while k is), or q auto beside k and v."""
    spec = _auto_beside_ring(autos)
    analysis = analyze(load_spec(spec), reshard=True, verify=True)
    assert analysis.ok
    assert {name: analysis.tensors()[name]["placements"] for name in autos} == {n: ["S(0)", "S(1)"] for n in autos}
    assert _ring_moves(analysis) == [("k", "attn/k_shift1", ["permute"], 128), ("v", "attn/v_shift1", ["permute"], 128)]
    assert run_graph(load_spec(spec), backward=True).ok


def test_the_whole_graph_choice_of_an_auto_that_drops_the_ring_is_not_taken(monkeypatch):
    """k also added to r (R, S(2)): the solver's choice, k (S(0), R), costs fewer bytes than complete's ring
    layout (forward) and was taken over it, dropping the ring; now it is not, and a note says so."""
    pytest.importorskip("scipy")
    spec = _auto_beside_ring(extra="kk")
    analysis, run = _analysed_and_run(spec, monkeypatch)
    assert analysis.ok
    assert analysis.tensors()["k"]["placements"] == ["S(0)", "S(1)"]
    assert ("complete: the whole-graph choice of the auto layouts (k (S(0), R)) drops the ring attn asks "
            "(context_parallel='ring'): not taken") in analysis.notes
    assert _ring_moves(analysis) == [("k", "attn/k_shift1", ["permute"], 128), ("v", "attn/v_shift1", ["permute"], 128)]
    assert run.ok
