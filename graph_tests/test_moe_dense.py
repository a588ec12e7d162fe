"""The dense global-capacity MoE buffer (``dense=True``): GShard / Switch's ``[experts, capacity,
hidden]`` with the capacity of all tokens, sharded by expert parallelism.

Tokens sharded on ``ep`` dispatch into a ``P(sum)`` buffer (each rank writes the global slots of
its own tokens), a reduce-scatter puts the experts on ``ep``, the experts run locally, and the
combine of an expert-sharded buffer is a ``P(sum)`` over all tokens, reduce-scattered back to the
token shards.  Every run is compared with one device, forward and backward.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from layout_prop.api import analyze
from layout_prop.cli import main
from layout_prop.core.errors import LayoutPropError
from layout_prop.io.loader import load_spec
from layout_prop.kernels.moe_numpy import KERNELS, route
from layout_prop.runner import run_graph

T, H, F, E, K = 8, 4, 6, 4, 2


def _layer(mesh: dict, token_axes: list[str], expert: list[str], capacity_factor=1.0, moves: bool = False) -> dict:
    """x (T, H) sharded on the token axes, router indices and weights, a dense dispatch, E
    experts (E, H, F) sharded on the expert placements, a dense combine; with ``moves`` the
    buffer is moved onto the experts and the output back to the tokens by explicit
    redistributions (the GShard path; else the resharding chooses)."""
    tokens = ["S(0)" if name in token_axes else "R" for name in mesh["names"]]
    attrs = {"num_experts": E, "capacity_factor": capacity_factor, "dense": True}
    nodes = [{"name": "buf", "op": "moe_dispatch", "inputs": ["x", "idx"], "attrs": attrs},
             {"name": "h", "op": "batch_matmul", "inputs": ["buf", "w1"]},
             {"name": "a", "op": "relu", "inputs": ["h"]},
             {"name": "o", "op": "batch_matmul", "inputs": ["a", "w2"]},
             {"name": "y", "op": "moe_combine", "inputs": ["o", "idx", "w"], "attrs": attrs}]
    if moves:
        nodes.insert(1, {"name": "be", "op": "redistribute", "inputs": ["buf"], "attrs": {"placements": expert}})
        nodes[2]["inputs"] = ["be", "w1"]
        nodes.append({"name": "yt", "op": "redistribute", "inputs": ["y"], "attrs": {"placements": tokens}})
    return {"mesh": mesh,
            "inputs": {"x": {"shape": [T, H], "placements": tokens},
                       "idx": {"shape": [T, K], "placements": ["R"] * len(tokens), "dtype": "int64",
                               "requires_grad": False},
                       "w": {"shape": [T, K], "placements": tokens},
                       "w1": {"shape": [E, H, F], "placements": expert},
                       "w2": {"shape": [E, F, H], "placements": expert}},
            "nodes": nodes,
            "outputs": ["yt" if moves else "y"]}


EP4 = {"shape": [4], "names": ["ep"]}
DP_EP = {"shape": [2, 2], "names": ["dp", "ep"]}


def test_the_dense_buffer_holds_every_kept_choice_at_its_global_slot():
    # 8 tokens, top-2 of 4 experts, capacity ceil(1.0 * 8 * 2 / 4) = 4 slots an expert
    rng = np.random.default_rng(0)
    x, idx = rng.standard_normal((T, H)), rng.integers(0, E, (T, K))
    buf = KERNELS["moe_dispatch"](x, idx, num_experts=E, capacity_factor=1.0, dense=True)
    assert buf.shape == (E, 4, H)
    kept = [[] for _ in range(E)]  # written out: each expert keeps its first 4 choices in (token, choice) order
    for t in range(T):
        for j in range(K):
            e = idx[t, j]
            if len(kept[e]) < 4:
                kept[e].append(t)
    for e in range(E):
        expected = np.zeros((4, H))
        expected[:len(kept[e])] = x[kept[e]]
        np.testing.assert_array_equal(buf[e], expected)
    # a rank's term: its tokens (4..7) at the same global slots, zeros elsewhere, summing to the whole
    low = KERNELS["moe_dispatch"](x[:4], idx, num_experts=E, capacity_factor=1.0, dense=True,
                                  tokens=T, token_start=0, local_tokens=4)
    high = KERNELS["moe_dispatch"](x[4:], idx, num_experts=E, capacity_factor=1.0, dense=True,
                                   tokens=T, token_start=4, local_tokens=4)
    np.testing.assert_array_equal(low + high, buf)
    assert route(idx, E, 1.0).slot.max() < 4


@pytest.mark.parametrize("mesh, token_axes, expert, moves", [
    (EP4, ["ep"], ["S(0)"], True),
    (EP4, ["ep"], ["S(0)"], False),
    (DP_EP, ["dp", "ep"], ["R", "S(0)"], False),
    (DP_EP, ["ep"], ["R", "S(0)"], True),
])
def test_expert_parallel_dense_layer_matches_one_device(mesh, token_axes, expert, moves):
    for cf in (1.0, None):  # with drops, and dropless (T slots an expert)
        report = run_graph(load_spec(_layer(mesh, token_axes, expert, cf, moves)), backward=True)
        assert report.ok, report.mismatches
        assert set(report.grads) >= {"x", "w", "w1", "w2"}


def test_the_dispatch_of_sharded_tokens_is_a_partial_sum_and_reduce_scatters_onto_the_experts():
    analysis = analyze(load_spec(_layer(EP4, ["ep"], ["S(0)"], moves=True)), reshard=True)
    assert analysis.ok
    tensors = analysis.tensors()
    assert tensors["buf"]["placements"] == ["P(sum)"]  # each rank wrote its own tokens' slots
    assert tensors["o"]["placements"] == ["S(0)"]  # the experts computed where they live
    assert tensors["y"]["placements"] == ["P(sum)"]  # each rank summed its experts' choices of all tokens
    moves = {r["node"]: r for r in analysis.report()["redistributions"]}
    assert [s["kind"] for s in moves["be"]["steps"]] == ["reduce-scatter"]
    assert [s["kind"] for s in moves["yt"]["steps"]] == ["reduce-scatter"]
    # a ring reduce-scatter sends (n - 1) / n of the buffer: 3/4 of E * capacity * H float32
    assert moves["be"]["bytes_per_rank"] == 3 * (E * 4 * H * 4) // 4
    assert moves["yt"]["bytes_per_rank"] == 3 * (T * H * 4) // 4
    # the combine reads the whole weights (every token's choices of the rank's experts)
    assert [r["node"] for r in analysis.report()["redistributions"]].count("y") == 1


def test_dense_with_groups_is_a_one_line_error():
    spec = _layer(EP4, ["ep"], ["S(0)"])
    spec["nodes"][0]["attrs"] = {"num_experts": E, "dense": True, "groups": 4}
    with pytest.raises(LayoutPropError) as err:
        analyze(load_spec(spec))
    assert err.value.code == "bad-attr" and "dense=True with groups=4" in str(err.value)


@pytest.mark.parametrize("attrs, needle", [
    ({"num_experts": E, "dense": True, "groups": 2}, "bad-attr at attrs.dense, node 'buf': moe_dispatch: dense=True "
                                                       "with groups=2"),
    ({"num_experts": E, "dense": True, "capacity_factor": 1.0, "capacity_scope": "group"}, "capacity_scope='group'"),
    ({"num_experts": E, "dense": "yes"}, "dense"),
])
def test_unusable_dense_attrs_are_one_line_exit_2(tmp_path, capsys, attrs, needle):
    spec = _layer(EP4, ["ep"], ["S(0)"])
    spec["nodes"][0]["attrs"] = attrs
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(spec))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
