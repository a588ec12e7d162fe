"""The step-time model (layout_prop.perf) and ``layout-prop estimate``: costs counted by hand,
collectives by their algorithms' formulas, bad profiles and batches refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import SpecError
from layout_prop.core.registry import registered_ops
from layout_prop.io.loader import load_spec
from layout_prop.perf.clusters import BUILTIN, get_cluster, parse_cluster
from layout_prop.perf.collectives import axis_span, collective_time
from layout_prop.perf.costs import cost_class, op_cost, op_time
from layout_prop.perf.step import estimate_step

A100 = BUILTIN["a100-80g"]


def test_every_built_in_op_has_a_cost_class():
    missing = sorted(name for name, rule in registered_ops().items()
                     if name == rule.name and type(rule).__module__.startswith("layout_prop.")
                     and cost_class(name) is None)
    assert missing == [], f"add these ops to a cost class in layout_prop/perf/costs.py: {missing}"


# ----------------------------------------------------------------------------- op costs
def test_matmul_family_counts_two_m_n_k():
    assert op_cost("matmul", ((3, 5, 7), (7, 11)), ((3, 5, 11),), (2, 2), (2,), {}).flops == 2 * 15 * 11 * 7
    assert op_cost("matmul", ((7, 5), (11, 7)), ((5, 11),), (4, 4), (4,), {"transpose_a": True}).flops == 2 * 55 * 7
    assert op_cost("linear", ((4, 6), (10, 6)), ((4, 10),), (4, 4), (4,), {}).flops == 2 * 4 * 10 * 6
    einsum = op_cost("einsum", ((2, 3, 4), (4, 5)), ((2, 3, 5),), (4, 4), (4,), {"equation": "bmk,kn->bmn"})
    assert einsum.flops == 2 * 2 * 3 * 4 * 5
    assert einsum.bytes == 4 * (24 + 20 + 30)


def test_attention_counts_both_products_and_its_gradient_twice():
    q = (2, 4, 16, 8)  # BNSD
    fwd = op_cost("scaled_dot_product_attention", (q, q, q), (q,), (2,) * 3, (2,), {})
    assert fwd.flops == 4 * 2 * 4 * 16 * 16 * 8
    bsnd = (2, 16, 4, 8)
    assert op_cost("scaled_dot_product_attention", (bsnd,) * 3, (bsnd,), (2,) * 3, (2,),
                   {"layout": "BSND"}).flops == fwd.flops
    grad = op_cost("scaled_dot_product_attention_grad", (q, q, q, q), (q, q, q), (2,) * 4, (2,) * 3, {})
    assert grad.flops == 2 * fwd.flops
    # flash_attention_score's fused layouts: BSH (H = N * D) and packed TND, counted as one sequence of T tokens
    bsh = (2, 16, 32)
    assert op_cost("flash_attention_score", (bsh,) * 3, (bsh,), (2,) * 3, (2,),
                   {"input_layout": "BSH", "head_num": 4}).flops == fwd.flops
    tnd = (32, 4, 8)
    assert op_cost("flash_attention_score", (tnd,) * 3, (tnd,), (2,) * 3, (2,),
                   {"input_layout": "TND", "head_num": 4}).flops == 4 * 32 * 32 * 4 * 8


#: an A100 SM's share of the measured large-GEMM throughput (267.9 TFLOP/s, 108 SMs) and of the L2 (4,956 GB/s)
SM_FLOPS, SM_L2 = 312e12 * round(267.9 / 312, 4) / 108, 2.3 * 2155e9 / 108
LAUNCH = 0.0  # the built-in profiles price no kernel launch (clusters.py LAUNCH says why)


def test_a_gemm_takes_whole_waves_of_tiles_and_at_least_its_bytes():
    # 4096^3: 256 x 128 tiles, 16 x 32 = 512 of them over 108 SMs: 5 waves (4.74 rounded up), each tile at the SM's
    # share of the measured throughput (128 x 128 tiles: 1,024 in 10 waves, the same time)
    big = op_cost("matmul", ((4096, 4096), (4096, 4096)), ((4096, 4096),), (2, 2), (2,), {}, dtype="float16")
    assert op_time(big, A100) == pytest.approx(5 * 2 * 256 * 128 * 4096 / SM_FLOPS + LAUNCH)
    # 109 x 256 rows by 128: 109 tiles of 256 x 128, one more than the SMs; 218 tiles of 128 x 128 in 3 waves (one
    # wave and a half of the big tile's time): a second wave for one tile
    one_more = op_cost("matmul", ((109 * 256, 4096), (4096, 128)), ((109 * 256, 128),), (2, 2), (2,), {},
                       dtype="float16")
    assert op_time(one_more, A100) == pytest.approx(3 * 2 * 128 * 128 * 4096 / SM_FLOPS + LAUNCH)
    # a thin GEMM (16 rows): its bytes through HBM at 80% of 2,039 GB/s take longer than its 3 waves of 256 64 x 64
    # tiles (which the L2 feeds at 32 FLOPs a byte: 64 * 64 / 128)
    thin = op_cost("matmul", ((16, 4096), (4096, 16384)), ((16, 16384),), (2, 2), (2,), {}, dtype="float16")
    memory = (16 * 4096 + 4096 * 16384 + 16 * 16384) * 2 / (2039e9 * 0.8)
    assert memory > 3 * 2 * 64 * 64 * 4096 / min(SM_FLOPS, 32 * SM_L2)
    assert op_time(thin, A100) == pytest.approx(memory + LAUNCH)
    add = op_cost("add", ((1024, 1024), (1024, 1024)), ((1024, 1024),), (4, 4), (4,), {})
    assert op_time(add, A100) == pytest.approx(3 * 4 * 2 ** 20 / (2039e9 * A100.memory_efficiency) + LAUNCH)
    assert op_time(op_cost("reshape", ((8, 8),), ((64,),), (4,), (4,), {}), A100) == 0.0


def test_a_profile_without_cores_keeps_the_flat_roofline():
    flat = dataclasses.replace(A100, cores=None)
    big = op_cost("matmul", ((4096, 4096), (4096, 4096)), ((4096, 4096),), (2, 2), (2,), {}, dtype="float16")
    assert op_time(big, flat) == pytest.approx(2 * 4096 ** 3 / (312e12 * flat.matmul_efficiency))


def test_fused_attention_runs_at_the_flash_attention_fraction_half_its_flops_when_causal():
    q = (1, 16, 4096, 128)  # BNSD
    full = op_cost("scaled_dot_product_attention", (q,) * 3, (q,), (2,) * 3, (2,), {}, dtype="float16")
    causal = op_cost("scaled_dot_product_attention", (q,) * 3, (q,), (2,) * 3, (2,), {"causal": True},
                     dtype="float16")
    grad = op_cost("scaled_dot_product_attention_grad", (q,) * 4, (q,) * 3, (2,) * 4, (2,) * 3, {"causal": True},
                   dtype="float16")
    flops = 4 * 16 * 4096 * 4096 * 128
    assert op_time(full, A100) == pytest.approx(flops / (312e12 * 0.73) + LAUNCH)  # FlashAttention-2's 73%
    assert op_time(causal, A100) == pytest.approx(flops / 2 / (312e12 * 0.73) + LAUNCH)
    assert op_time(grad, A100) == pytest.approx(2 * flops / 2 / (312e12 * 0.50) + LAUNCH)


# ----------------------------------------------------------------------------- collectives
def test_axes_fill_nodes_innermost_first():
    assert axis_span((32, 8), 1, 8) == (8, 1)  # tp=8 inside a node
    assert axis_span((32, 8), 0, 8) == (1, 32)  # dp across 32 nodes, one member each
    assert axis_span((4, 4, 2), 1, 8) == (4, 1)
    assert axis_span((4, 4, 2), 0, 8) == (1, 4)
    assert axis_span((2, 16), 1, 8) == (8, 2)  # 16 ranks on 2 nodes
    assert axis_span((5, 1), 1, 8) == (1, 1)


def test_collectives_follow_their_algorithms():
    eff = A100.link_efficiency
    b = 64 * 2 ** 20
    # a ring all-gather inside a node: the bytes over NVLink, 7 latencies
    assert collective_time("all-gather", b, (8,), 0, A100) == pytest.approx(b / (300e9 * eff) + 7 * 3e-6)
    # across nodes, one member a node: over the rails
    assert collective_time("reduce-scatter", b, (4, 8), 0, A100) == pytest.approx(b / (25e9 * eff) + 3 * 6e-6)
    # an all-reduce of a small buffer across many nodes: the tree's latency wins over the ring's
    small, n = 1024, 64
    ring = small / (25e9 * eff) + 2 * (n - 1) * 6e-6
    tree = 2 * (small * n / (2 * (n - 1))) / (25e9 * eff) + 2 * 6 * 6e-6
    assert collective_time("all-reduce", small, (n, 8), 0, A100) == pytest.approx(min(ring, tree)) == \
        pytest.approx(tree)
    # hierarchical: 16 members on 2 nodes; the buffer S = nbytes * n / (2 (n - 1))
    n, g, m = 16, 8, 2
    nbytes = 2 * (n - 1) / n * b
    inside = 2 * ((b * (g - 1) / g) / (300e9 * eff) + (g - 1) * 3e-6)
    across = (2 * (m - 1) / m * b / g) / (25e9 * eff) + 2 * (m - 1) * 6e-6
    assert collective_time("all-reduce", nbytes, (n,), 0, A100) == pytest.approx(inside + across)
    assert collective_time("local-slice", b, (8,), 0, A100) == 0.0
    assert collective_time("all-gather", b, (1,), 0, A100) == 0.0


# ----------------------------------------------------------------------------- the step
SPEC = """
mesh: {shape: [2], names: [dp]}
inputs:
  x: {shape: [8, 1024], placements: ["S(0)"], requires_grad: false, dtype: float16}
  w: {shape: [1024, 1024], dtype: float16}
nodes:
  - {name: y, op: matmul, inputs: [x, w]}
outputs: [y]
"""


def _graph(text=SPEC):
    analysis = analyze(load_spec(text), reshard=True, backward=True)
    assert analysis.ok
    return analysis.graph


def test_a_data_parallel_matmul_step_is_counted_by_hand():
    est = estimate_step(_graph(), A100, overlap=False)
    local_flops = 2 * 4 * 1024 * 1024  # per rank: 4 rows of x
    # one wave of 16 tiles of 64 x 64 (the L2 feeds them 32 FLOPs a byte): longer than the bytes through HBM
    tiles = 2 * 64 * 64 * 1024 / min(SM_FLOPS, 32 * SM_L2)
    assert tiles > (4 * 1024 + 1024 * 1024 + 4 * 1024) * 2 / (2039e9 * 0.8)
    assert est.forward_s == pytest.approx(tiles + LAUNCH)
    # backward: dw = x^T dy (dx is not needed: x takes no gradient)
    assert est.backward_s > 0
    grad_bytes = 1024 * 1024 * 2  # w's gradient, float16, all-reduced over dp (2 ranks)
    assert est.grad_sync_s == pytest.approx(collective_time("all-reduce", grad_bytes, (2,), 0, A100))
    assert est.grad_sync_exposed_s == est.grad_sync_s  # --no-overlap
    # AdamW on 1024 x 1024 float16 parameters: the gradient read (2 bytes), the float32 master and two moments read
    # and written (24), the float16 copy written (2): 28 bytes a parameter
    assert est.optimizer_s == pytest.approx(1024 * 1024 * 28 / (2039e9 * 0.8))
    assert est.step_time_s == pytest.approx(est.forward_s + est.backward_s + est.grad_sync_s + est.optimizer_s)
    assert est.flops_per_step == pytest.approx(2 * (local_flops + local_flops))  # two ranks, forward and dw


def test_accumulation_repeats_compute_not_the_gradient_sync():
    one = estimate_step(_graph(), A100)
    four = estimate_step(_graph(), A100, global_batch=32, micro_batch=4)  # 32 / (4 x dp 2) = 4
    assert four.accumulation == 4
    # each micro-batch after the first adds w's float16 gradient into the sum: 3 x 2 MiB through HBM, 3 times
    accumulate = 3 * 3 * 1024 * 1024 * 2 / (2039e9 * 0.8)
    assert four.compute_s == pytest.approx(4 * one.compute_s + accumulate)
    assert four.backward_s == pytest.approx(4 * one.backward_s + accumulate)
    assert four.grad_sync_s == pytest.approx(one.grad_sync_s)
    full = estimate_step(_graph(), A100, recompute="full")
    assert full.recompute_s == pytest.approx(one.forward_s)


def test_overlap_hides_what_the_backward_covers():
    hidden = estimate_step(_graph(), A100)
    exposed = estimate_step(_graph(), A100, overlap=False)
    assert hidden.grad_sync_exposed_s <= exposed.grad_sync_exposed_s
    assert hidden.grad_sync_exposed_s >= min(hidden.grad_sync_s, exposed.grad_sync_s - hidden.backward_s) - 1e-15


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("data, code", [
    ({"base": "a100-80g", "inter": {"GBps": -5}}, "bad-value"),
    ({"base": "a100-80g", "peak_tflops": {"float8": 1000}}, "bad-dtype"),
    ({"base": "a100-80g", "matmul_efficiency": 1.5}, "bad-value"),
    ({"base": "b200"}, "unknown-cluster"),
    ({"devices_per_node": 8}, "missing-key"),
    ({"base": "a100-80g", "hbm_GBps": float("inf")}, "bad-value"),
    ({"base": "a100-80g", "colour": "green"}, "unknown-key"),
    ([1, 2], "bad-type"),
])
def test_bad_profiles_are_typed_errors(data, code):
    with pytest.raises(SpecError) as err:
        parse_cluster(data)
    assert err.value.code == code


def _cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_estimate_json_and_bad_input(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    code, out, err = _cli(["estimate", str(spec), "--cluster", "h100-80g", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    for key in ("step_time_s", "compute_s", "communication_s", "tflops_per_device", "mfu", "memory_per_rank_bytes",
                "breakdown"):
        assert key in data
    assert 0 < data["mfu"] < 1 and math.isclose(data["step_time_s"], data["compute_s"] + data["communication_s"]
                                                 + data["optimizer_s"])
    small = tmp_path / "small.yaml"
    small.write_text("base: a100-80g\nnodes: 1\ndevices_per_node: 1\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: a100-80g\ninter: {GBps: -1}\n")
    for argv, code_want in (
            (["--cluster", str(bad)], "bad-value"),
            (["--cluster", str(small)], "mesh-too-large"),
            (["--cluster", "a100-80g", "--global-batch", "6", "--micro-batch", "4"], "bad-value"),
            (["--cluster", "a100-80g", "--global-batch", "8"], "bad-value"),
            # no step's batch: 10^30 printed a step of 10^28 ms, 10^400 was an internal error (float overflow)
            (["--cluster", "a100-80g", "--global-batch", str(10**30), "--micro-batch", "1"], "bad-batch"),
            (["--cluster", "a100-80g", "--global-batch", str(10**400), "--micro-batch", "1"], "bad-batch"),
            (["--cluster", "a100-80g", "--global-batch", str(2**24 + 2), "--micro-batch", "1"], "bad-batch"),
            (["--cluster", "tpu-v9"], "unknown-cluster")):
        code, out, err = _cli(["estimate", str(spec), *argv], capsys)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and code_want in err, (argv, err)


#: a time as estimate prints it: the number, its unit
_TIME = re.compile(r"(-?[\d,]+(?:\.(\d+))?) (ns|us|ms)\b")
_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3}


def _times(line: str) -> list[tuple[float, float]]:
    """Every time printed in ``line``, each as (seconds, half of its last printed digit in seconds)."""
    found = []
    for number, decimals, unit in _TIME.findall(line):
        scale = _UNITS[unit]
        found.append((float(number.replace(",", "")) * scale, 0.5 * 10 ** -len(decimals) * scale + 1e-15))
    return found


def _reads_back(line: str, *values: float) -> None:
    times = _times(line)
    assert len(times) == len(values), line
    for (printed, tolerance), value in zip(times, values):
        assert abs(printed - value) <= tolerance, (line, value)


def test_a_small_model_s_estimate_prints_its_times_in_the_unit_that_shows_them(tmp_path, capsys):
    """gen llama on 8 A100s printed 'compute 0.000 ms (forward 0.000 ms, ...)', '0.0 TFLOP/s per device, MFU 0.0%'
    and op times like '0.018 ms': each time now reads back as the JSON's to its printed precision (us, ns below a
    millisecond), the rate is not 0.0 and the MFU says '<0.1%'."""
    path = tmp_path / "llama.yaml"
    assert main(["gen", "llama", "-o", str(path)]) == 0
    code, text, err = _cli(["estimate", str(path), "--cluster", "a100-80g"], capsys)
    assert code == 0, err
    code, out, err = _cli(["estimate", str(path), "--cluster", "a100-80g", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    parts = data["breakdown"]
    lines = text.splitlines()
    assert "0.000 ms" not in text and "0.0 TFLOP/s" not in text, text
    assert data["step_time_s"] < 1e-3 and 0 < parts["forward_s"] < 1e-4  # (us: a toy)
    _reads_back(lines[0], data["step_time_s"])
    _reads_back(lines[1], data["compute_s"], parts["forward_s"], parts["backward_s"], parts["recompute_s"])
    _reads_back(lines[2], data["communication_s"], parts["grad_sync_s"], parts["grad_sync_exposed_s"])
    optimizer = next(line for line in lines if line.startswith("  optimizer"))
    _reads_back(optimizer, data["optimizer_s"])
    ops = lines[lines.index("most expensive ops (per step):") + 1:][:len(data["top_ops"])]
    for line, op in zip(ops, data["top_ops"]):
        _reads_back(line, op["seconds"])
    rate = next(line for line in lines if "TFLOP/s per device" in line)
    assert 0 < data["mfu"] < 0.0005 and "MFU <0.1%" in rate, rate
    assert float(rate.split()[0]) == pytest.approx(data["tflops_per_device"], rel=0.05), rate


def test_a_large_estimate_keeps_its_milliseconds_and_counts_get_separators(tmp_path, capsys):
    """From a millisecond up a time prints as it always did (three decimals of ms: the docs' transcripts of large
    models), and 2^23 accumulation steps print as '8,388,608', not '8388608'."""
    from layout_prop.commands.estimate import _mfu, _tflops, _time

    assert [_time(t) for t in (5.5064, 0.0010004, 0.00099951, 31.13)] == [
        "5,506.400 ms", "1.000 ms", "1.000 ms", "31,130.000 ms"]
    assert [_time(t) for t in (0.000999, 1.8e-5, 4.2e-9, 0.0)] == ["999.0 us", "18.0 us", "4.2 ns", "0 ms"]
    assert (_tflops(125.06), _mfu(0.4012), _mfu(0.0)) == ("125.1", "40.1%", "0.0%")
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    code, out, err = _cli(["estimate", str(spec), "--cluster", "a100-80g", "--global-batch", str(2**24),
                           "--micro-batch", "1"], capsys)
    assert code == 0, err
    assert "(8,388,608 accumulation steps)" in out.splitlines()[0], out


def test_builtin_profiles_name_a_source_for_every_figure():
    for cluster in BUILTIN.values():
        for key in ("peak_tflops", "hbm", "intra", "inter", "latency", "efficiency"):
            assert cluster.sources.get(key), (cluster.name, key)
    assert get_cluster("ascend-910b").devices_per_node == 8


def test_every_device_model_constant_has_a_source_and_a_file_profile_inherits_them():
    from layout_prop.perf.clusters import BUILTIN, parse_cluster

    for name, profile in BUILTIN.items():
        assert profile.cores, name
        for key in ("cores", "gemm_tiles", "gemm_efficiency", "l2_GBps", "attention_efficiency", "launch_us"):
            assert profile.sources.get(key), (name, key)
    # the measured large-GEMM fractions: 267.9 of 312 (A100 SXM), 792.1 of 989 (H100 SXM)
    assert BUILTIN["a100-80g"].peak_flops("bfloat16") * BUILTIN["a100-80g"].gemm_efficiency == pytest.approx(267.9e12,
                                                                                                         rel=1e-4)
    assert BUILTIN["h100-80g"].peak_flops("bfloat16") * BUILTIN["h100-80g"].gemm_efficiency == pytest.approx(792.1e12,
                                                                                                         rel=1e-4)
    mine = parse_cluster({"base": "h100-80g", "inter": {"GBps": 100}})
    assert (mine.cores, mine.gemm_efficiency, mine.l2_GBps) == (132, BUILTIN["h100-80g"].gemm_efficiency,
                                                                BUILTIN["h100-80g"].l2_GBps)
    big = op_cost("matmul", ((8192, 8192), (8192, 8192)), ((8192, 8192),), (2, 2), (2,), {}, dtype="bfloat16")
    assert op_time(big, mine) == op_time(big, BUILTIN["h100-80g"])
