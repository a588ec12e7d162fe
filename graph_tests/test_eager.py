"""Eager dispatch on simulated DTensors: the upstream scenarios forward and backward, the
hyper-parallel preprocess / infer_layout contract, and the gradient layout rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from layout_prop import DeviceMesh
from layout_prop.engines.dtensor import DTensor, distribute
from layout_prop.engines.eager import DistributedOp, rotary_position_embedding, rotary_position_embedding_grad
from layout_prop.core.errors import OpError
from layout_prop.kernels.rpe_numpy import rpe_backward, rpe_forward

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "rpe"
SCENARIOS = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


def _load(name):
    data = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    mesh = DeviceMesh(data["mesh"]["shape"], data["mesh"]["names"])
    placements = {}
    for key, entry in data["inputs"].items():
        if "tensor_map" in entry:
            from layout_prop.core.layout import Layout

            placements[key] = list(Layout.from_tensor_map(mesh, entry["tensor_map"]).placements)
        else:
            placements[key] = entry["placements"]
    shapes = {key: tuple(entry["shape"]) for key, entry in data["inputs"].items()}
    return mesh, shapes, placements


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("name", SCENARIOS)
def test_eager_scenario_forward_and_backward(name, mode):
    mesh, shapes, placements = _load(name)
    rng = np.random.default_rng(mode)
    x_g = rng.standard_normal(shapes["x"]).astype(np.float32)
    cos_g = rng.standard_normal(shapes["cos"]).astype(np.float32)
    sin_g = rng.standard_normal(shapes["sin"]).astype(np.float32)
    dy_g = rng.standard_normal(shapes["x"]).astype(np.float32)
    x = distribute(x_g, mesh, placements["x"])
    cos = distribute(cos_g, mesh, placements["cos"])
    sin = distribute(sin_g, mesh, placements["sin"])
    y = rotary_position_embedding(x, cos, sin, mode)
    assert y.placements == x.placements  # the output layout is x's, whatever the mode
    np.testing.assert_allclose(y.full_tensor(), rpe_forward(x_g, cos_g, sin_g, mode), rtol=1e-5, atol=1e-5)

    dy = distribute(dy_g, mesh, [str(p) for p in y.placements])
    dx, dcos, dsin = rotary_position_embedding_grad(dy, x, cos, sin, mode=mode)
    ref_dx, ref_dcos, ref_dsin = rpe_backward(dy_g.astype(np.float64), x_g.astype(np.float64),
                                              cos_g.astype(np.float64), sin_g.astype(np.float64), mode)
    assert dx.placements == x.placements
    np.testing.assert_allclose(dx.full_tensor(), ref_dx, rtol=1e-4, atol=1e-4)
    # bring the cos/sin gradients to cos/sin's own layout (the reductions upstream forgets)
    dcos_back = dcos.redistribute([str(p) for p in cos.placements])
    dsin_back = dsin.redistribute([str(p) for p in sin.placements])
    np.testing.assert_allclose(dcos_back.full_tensor(), ref_dcos, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dsin_back.full_tensor(), ref_dsin, rtol=1e-4, atol=1e-4)


def test_gradient_layout_is_partial_where_cos_broadcasts_along_a_sharded_dim():
    mesh, shapes, placements = _load("dp_tp_sp")
    rng = np.random.default_rng(1)
    x = distribute(rng.standard_normal(shapes["x"]), mesh, placements["x"])
    cos = distribute(rng.standard_normal(shapes["cos"]), mesh, placements["cos"])
    dx, dcos, dsin = rotary_position_embedding_grad(x, x, cos, cos, mode=0)
    # cos is (1, 1, S, D): B (dp) and N (tp) broadcast -> partial sums; S (sp) sharded like x
    assert [str(p) for p in dcos.placements] == ["P(sum)", "P(sum)", "S(2)"]
    # the ranks of one dp group hold different terms of the same block: no replica agreement
    assert not np.allclose(dcos.to_local(0), dcos.to_local(4))


def test_replicate_cos_is_sliced_before_the_kernel():
    mesh = DeviceMesh((2,), ("sp",))
    op = DistributedOp("rotary_position_embedding")
    x = distribute(np.ones((1, 1, 4, 8)), mesh, ["S(2)"])
    cos = np.ones((1, 1, 4, 8))  # plain array: Replicate
    local_args, local_kwargs, cache = op.preprocess((x, cos, cos), {"mode": 0})
    assert [a.shape for a in local_args[1]] == [(1, 1, 2, 8)] * 3
    (out,), extra = op.infer_layout(cache)
    assert str(out) == "(S(2))" and extra is None
    assert local_kwargs[0]["mode"] == 0


def test_infer_layout_is_cached_on_layouts_shapes_and_mode():
    mesh = DeviceMesh((2,), ("dp",))
    op = DistributedOp("rotary_position_embedding")
    x = distribute(np.ones((2, 1, 4, 8)), mesh, ["S(0)"])
    _, _, c1 = op.preprocess((x, np.ones((1, 1, 4, 8)), np.ones((1, 1, 4, 8))), {"mode": 1})
    _, _, c2 = op.preprocess((x, np.ones((1, 1, 4, 8)), np.ones((1, 1, 4, 8))), {"rotary_mode": "interleave"})
    assert c1 == c2 and len(op._cache) == 1
    op.preprocess((x, np.ones((1, 1, 4, 8)), np.ones((1, 1, 4, 8))), {"mode": 0})
    assert len(op._cache) == 2


def test_infer_layout_cache_tells_mode_1_from_mode_true():
    mesh = DeviceMesh((2,), ("dp",))
    op = DistributedOp("rotary_position_embedding")
    x = distribute(np.ones((2, 1, 4, 8)), mesh, ["S(0)"])
    cos = np.ones((1, 1, 4, 8))
    op.preprocess((x, cos, cos), {"mode": 1})
    with pytest.raises(OpError) as info:  # True == 1 in Python, but True is not a mode
        op.preprocess((x, cos, cos), {"mode": True})
    assert info.value.code == "invalid-mode"


@pytest.mark.parametrize("kwargs,mode", [({"rotary_mode": "half"}, 0), ({"rotary_mode": "interleave"}, 1),
                                         ({"rotary_mode": None}, 0), ({"mode": 3}, 3)])
def test_torch_npu_rotary_mode_names(kwargs, mode):
    mesh = DeviceMesh((2,), ("dp",))
    rng = np.random.default_rng(0)
    x_g, c_g = rng.standard_normal((2, 1, 3, 8)), rng.standard_normal((1, 1, 3, 8))
    y = rotary_position_embedding(distribute(x_g, mesh, ["S(0)"]), c_g, c_g, **kwargs)
    np.testing.assert_allclose(y.full_tensor(), rpe_forward(x_g, c_g, c_g, mode))


def test_bad_rotary_mode_and_violations_raise_typed_errors():
    mesh = DeviceMesh((2,), ("dp",))
    x = distribute(np.ones((2, 1, 4, 8)), mesh, ["S(0)"])
    with pytest.raises(OpError) as info:
        rotary_position_embedding(x, np.ones((1, 1, 4, 8)), np.ones((1, 1, 4, 8)), rotary_mode="quarter")
    assert info.value.code == "invalid-mode" and "quarter" in info.value.message
    d_sharded = distribute(np.ones((2, 1, 4, 8)), mesh, ["S(3)"])
    with pytest.raises(OpError) as info:
        rotary_position_embedding(d_sharded, np.ones((1, 1, 4, 8)), np.ones((1, 1, 4, 8)))
    assert info.value.code == "sharded-rotation-dim" and "'dp'" in info.value.message


def test_dtensor_rejects_wrong_local_shapes():
    mesh = DeviceMesh((2,), ("dp",))
    t = distribute(np.ones((4, 2)), mesh, ["S(0)"])
    with pytest.raises(Exception) as info:
        DTensor([np.ones((4, 2)), np.ones((4, 2))], t.spec)
    assert getattr(info.value, "code", None) == "local-shape-mismatch"
