"""RotaryPositionEmbedding kernels: numpy forward / backward, MindSpore, CANN constraints.

Expected values come from references written here (explicit concatenations per mode,
explicit per-index rotation tables, central finite differences, MindSpore autodiff),
never from the code under test.
"""

from __future__ import annotations

import doctest
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.core.errors import ExecutionError, OpError
from layout_prop.kernels import rpe_cann, rpe_mindspore, rpe_numpy
from layout_prop.kernels.rpe_cann import cann_available, check_cann_constraints
from layout_prop.kernels.rpe_mindspore import rpe_forward_ms
from layout_prop.kernels.rpe_numpy import (
    arrange,
    arrange_t,
    normalize_mode,
    reduce_to_shape,
    rotate,
    rotate_t,
    rpe_backward,
    rpe_forward,
    rpe_forward_reference,
)

MODES = (0, 1, 2, 3)
DTYPES = (np.float16, np.float32, np.float64)
# float16 is computed in float32 and rounded once (half an ulp, 2**-11 relative);
# float32 in float32 (a few ulps of the two products); float64 in float64.
TOLERANCES = {
    np.dtype(np.float16): dict(rtol=1e-3, atol=1e-4),
    np.dtype(np.float32): dict(rtol=1e-6, atol=1e-6),
    np.dtype(np.float64): dict(rtol=1e-13, atol=1e-13),
}
NO_ASCEND = "no Ascend device"


# ----------------------------------------------------------------------------- references


def reference_forward(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: int) -> np.ndarray:
    """The op's definition, literally, in float64 (numpy broadcasting for cos / sin)."""
    x, cos, sin = (np.asarray(a, dtype=np.float64) for a in (x, cos, sin))
    d = x.shape[-1]
    if mode == 0:
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + np.concatenate([-x2, x1], axis=-1) * sin
    if mode == 1:
        even, odd = x[..., 0::2], x[..., 1::2]
        return x * cos + np.stack([-odd, even], axis=-1).reshape(x.shape) * sin
    if mode == 2:
        q1, q2, q3, q4 = (x[..., i * d // 4 : (i + 1) * d // 4] for i in range(4))
        return x * cos + np.concatenate([-q2, q1, -q4, q3], axis=-1) * sin
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.concatenate([even, odd], axis=-1) * cos + np.concatenate([-odd, even], axis=-1) * sin


def rotation_source(j: int, d: int, mode: int) -> tuple[int, int]:
    """(source index, sign) of output position j of rotate(x), from the mode's definition."""
    half, quarter = d // 2, d // 4
    if mode == 0:
        return (j + half, -1) if j < half else (j - half, +1)
    if mode == 1:
        return (j + 1, -1) if j % 2 == 0 else (j - 1, +1)
    if mode == 2:
        block, offset = divmod(j, quarter)
        source_block, sign = {0: (1, -1), 1: (0, +1), 2: (3, -1), 3: (2, +1)}[block]
        return source_block * quarter + offset, sign
    return (2 * j + 1, -1) if j < half else (2 * (j - half), +1)


def arrangement_source(j: int, d: int, mode: int) -> int:
    """Source index of output position j of arrange(x) (the factor of cos)."""
    if mode != 3:
        return j
    half = d // 2
    return 2 * j if j < half else 2 * (j - half) + 1


def rotate_by_index(x: np.ndarray, mode: int) -> np.ndarray:
    out = np.empty_like(x)
    for j in range(x.shape[-1]):
        source, sign = rotation_source(j, x.shape[-1], mode)
        out[..., j] = sign * x[..., source]
    return out


def numeric_gradient(loss, array: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar ``loss()`` with respect to ``array`` (in place)."""
    grad = np.zeros_like(array)
    for index in np.ndindex(*array.shape):
        saved = array[index]
        array[index] = saved + eps
        plus = loss()
        array[index] = saved - eps
        minus = loss()
        array[index] = saved
        grad[index] = (plus - minus) / (2 * eps)
    return grad


def make_inputs(x_shape, cos_shape, dtype, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(dtype)
    cos = rng.uniform(-1.0, 1.0, cos_shape).astype(dtype)
    sin = rng.uniform(-1.0, 1.0, cos_shape).astype(dtype)
    return x, cos, sin


@st.composite
def rpe_cases(draw, dtypes=DTYPES):
    """(mode, x_shape, cos_shape, dtype, seed): 3-D or 4-D x with size-1 and odd dims,
    cos of any rank up to x's, each leading dim broadcast (1) or full."""
    mode = draw(st.sampled_from(MODES))
    head_dim = (4 if mode == 2 else 2) * draw(st.integers(1, 5))
    leading = draw(st.lists(st.sampled_from([1, 2, 3, 5]), min_size=2, max_size=3))
    x_shape = tuple(leading) + (head_dim,)
    cos_rank = draw(st.integers(1, len(x_shape)))
    cos_leading = tuple(draw(st.sampled_from([1, size])) for size in x_shape[len(x_shape) - cos_rank : -1])
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    return mode, x_shape, cos_leading + (head_dim,), dtype, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("module", [rpe_numpy, rpe_mindspore, rpe_cann], ids=lambda module: module.__name__)
def test_docstring_examples_run(module):
    if module is rpe_mindspore:
        pytest.importorskip("mindspore")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_reference_matches_hand_computed_rotations():
    """The test's own reference, pinned on x = 0..7 with cos = 0, sin = 1 (y = rotate(x))."""
    x = np.arange(8.0)
    expected = {
        0: [-4, -5, -6, -7, 0, 1, 2, 3],
        1: [-1, 0, -3, 2, -5, 4, -7, 6],
        2: [-2, -3, 0, 1, -6, -7, 4, 5],
        3: [-1, -3, -5, -7, 0, 2, 4, 6],
    }
    for mode, values in expected.items():
        np.testing.assert_array_equal(reference_forward(x, np.zeros(8), np.ones(8), mode), values)
        np.testing.assert_array_equal(rotate_by_index(x, mode), values)
    # mode 3 also permutes the cos term: cat(even, odd)
    np.testing.assert_array_equal(reference_forward(x, np.ones(8), np.zeros(8), 3), [0, 2, 4, 6, 1, 3, 5, 7])


# ------------------------------------------------------------------ (a) numpy forward


@settings(max_examples=80, deadline=None)
@given(rpe_cases())
def test_forward_matches_reference(case):
    mode, x_shape, cos_shape, dtype, seed = case
    x, cos, sin = make_inputs(x_shape, cos_shape, dtype, seed)
    expected = reference_forward(x, cos, sin, mode)
    for result in (rpe_forward(x, cos, sin, mode), rpe_forward_reference(x, cos, sin, mode)):
        assert result.dtype == dtype and result.shape == x_shape
        np.testing.assert_allclose(result.astype(np.float64), expected, **TOLERANCES[dtype])


@settings(max_examples=60, deadline=None)
@given(rpe_cases(), st.sampled_from([16, 64, 256, 4096, 1 << 17]), st.booleans())
def test_fast_path_equals_reference_path_exactly(case, block_bytes, full_size_sin):
    """Blocked fast path == plain reference path, bit for bit, whatever the blocking."""
    mode, x_shape, cos_shape, dtype, seed = case
    if full_size_sin:
        cos_shape = x_shape
    x, cos, sin = make_inputs(x_shape, cos_shape, dtype, seed)
    out = np.full(x_shape, np.nan, dtype)
    result = rpe_forward(x, cos, sin, mode, out=out, block_bytes=block_bytes)
    assert result is out
    np.testing.assert_array_equal(out, rpe_forward_reference(x, cos, sin, mode))

@st.composite
def blocked_cases(draw):
    """(mode, x_shape, cos_shape, dtype, seed, block_bytes) for every path of the blocked
    loop: head dims up to 128 with and without a take plan, 2-D to 4-D x with size-1 and
    odd dims, cos of any rank (broadcast or as large as x, so that sin is signed once or
    block by block), and blocks of a few rows plus a part row, so that the last block of
    a walked row is shorter and blocks span several outer indices."""
    mode = draw(st.sampled_from(MODES))
    head_dim = draw(st.sampled_from([4, 8, 12, 16, 24, 32, 64, 128]))  # multiples of 4: every mode
    leading = draw(st.lists(st.sampled_from([1, 2, 3, 5, 7]), min_size=1, max_size=3))
    x_shape = tuple(leading) + (head_dim,)
    cos_rank = draw(st.integers(1, len(x_shape)))
    cos_leading = tuple(draw(st.sampled_from([1, size])) for size in x_shape[len(x_shape) - cos_rank : -1])
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    row_bytes = head_dim * max(dtype.itemsize, 4)  # float16 is blocked as float32
    block_bytes = draw(st.integers(1, 11)) * row_bytes + draw(st.integers(0, row_bytes - 1))
    return mode, x_shape, cos_leading + (head_dim,), dtype, draw(st.integers(0, 2**32 - 1)), block_bytes


@settings(max_examples=150, deadline=None)
@given(blocked_cases())
def test_blocked_forward_matches_the_definition_on_every_path(case):
    """Blocked fast path: bit for bit the reference path, and close to the literal formula."""
    mode, x_shape, cos_shape, dtype, seed, block_bytes = case
    x, cos, sin = make_inputs(x_shape, cos_shape, dtype, seed)
    out = np.full(x_shape, np.nan, dtype)
    result = rpe_forward(x, cos, sin, mode, out=out, block_bytes=block_bytes)
    assert result is out
    np.testing.assert_array_equal(out, rpe_forward_reference(x, cos, sin, mode))
    np.testing.assert_allclose(out.astype(np.float64), reference_forward(x, cos, sin, mode), **TOLERANCES[dtype])


@pytest.mark.parametrize("mode", MODES)
def test_forward_on_strided_views_and_mode_names(mode):
    x, cos, sin = make_inputs((2, 5, 3, 8), (5, 1, 8), np.float32, seed=mode)
    bnsd_view = x.transpose(0, 2, 1, 3)  # a BSND array read as BNSD: not contiguous
    cos_view = cos.transpose(1, 0, 2)
    sin_view = sin.transpose(1, 0, 2)
    expected = reference_forward(bnsd_view, cos_view, sin_view, mode)
    result = rpe_forward(bnsd_view, cos_view, sin_view, ("half", "interleave", "quarter", "interleave-half")[mode])
    np.testing.assert_allclose(result, expected, **TOLERANCES[np.dtype(np.float32)])


def test_forward_of_empty_tensor():
    x = np.zeros((0, 3, 4), np.float32)
    assert rpe_forward(x, np.ones((3, 4), np.float32), np.ones((3, 4), np.float32)).shape == (0, 3, 4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_dim", [8, 16])
def test_rotate_and_arrange_match_index_definitions(mode, head_dim):
    x = np.random.default_rng(head_dim).standard_normal((3, head_dim))
    np.testing.assert_array_equal(rotate(x, mode), rotate_by_index(x, mode))
    sources = [arrangement_source(j, head_dim, mode) for j in range(head_dim)]
    np.testing.assert_array_equal(arrange(x, mode), x[:, sources])


@pytest.mark.parametrize("mode", MODES)
def test_transposes_are_adjoints(mode):
    """<rotate(x), g> == <x, rotate_t(g)> and the same for arrange (exact maps, exact sums)."""
    rng = np.random.default_rng(mode)
    x, g = rng.integers(-9, 9, (2, 3, 16)).astype(np.float64), rng.integers(-9, 9, (2, 3, 16)).astype(np.float64)
    assert np.sum(rotate(x, mode) * g) == np.sum(x * rotate_t(g, mode))
    assert np.sum(arrange(x, mode) * g) == np.sum(x * arrange_t(g, mode))
    np.testing.assert_array_equal(rotate_t(rotate(x, mode), mode), x)


def test_reduce_to_shape_sums_broadcast_dims():
    g = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(reduce_to_shape(g, (3, 1)), g.sum(axis=(0, 2))[:, None])
    np.testing.assert_array_equal(reduce_to_shape(g, (1, 1, 4)), g.sum(axis=(0, 1))[None, None])
    np.testing.assert_array_equal(reduce_to_shape(g, (2, 3, 4)), g)


# ----------------------------------------------------------------- (b) numpy backward

BACKWARD_SHAPES = [
    ((2, 3, 2, 8), (1, 1, 2, 8)),  # BNSD with 11SD cos
    ((2, 3, 2, 8), (2, 1, 2, 8)),  # B1SD
    ((3, 2, 8), (2, 8)),  # lower-rank cos
    ((1, 2, 8), (1, 2, 8)),  # full-size cos
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x_shape, cos_shape", BACKWARD_SHAPES)
def test_backward_matches_finite_differences(mode, x_shape, cos_shape):
    x, cos, sin = make_inputs(x_shape, cos_shape, np.float64, seed=7 + mode)
    dy = np.random.default_rng(mode).standard_normal(x_shape)
    dx, dcos, dsin = rpe_backward(dy, x, cos, sin, mode)

    def loss():
        return float(np.sum(dy * reference_forward(x, cos, sin, mode)))

    for analytic, wrt in ((dx, x), (dcos, cos), (dsin, sin)):
        assert analytic.shape == wrt.shape and analytic.dtype == np.float64
        np.testing.assert_allclose(analytic, numeric_gradient(loss, wrt), rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_backward_in_low_precision(dtype):
    """float16 / float32 gradients keep x's dtype and match float64 finite differences."""
    x, cos, sin = make_inputs((2, 3, 4), (3, 4), dtype, seed=1)
    dy = np.random.default_rng(2).standard_normal(x.shape).astype(dtype)
    x64, cos64, sin64, dy64 = (a.astype(np.float64) for a in (x, cos, sin, dy))

    def loss():
        return float(np.sum(dy64 * reference_forward(x64, cos64, sin64, 0)))

    for result, wrt in zip(rpe_backward(dy, x, cos, sin), (x64, cos64, sin64)):
        assert result.dtype == dtype and result.shape == wrt.shape
        np.testing.assert_allclose(result, numeric_gradient(loss, wrt), rtol=5e-3, atol=5e-3)


@pytest.fixture(scope="module")
def mindspore_kernels():
    pytest.importorskip("mindspore")
    from layout_prop.kernels import rpe_mindspore

    return rpe_mindspore


@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_mindspore_autodiff(mindspore_kernels, mode):
    for x_shape, cos_shape in (((2, 3, 4, 8), (1, 1, 4, 8)), ((3, 4, 8), (4, 8))):
        x, cos, sin = make_inputs(x_shape, cos_shape, np.float64, seed=mode)
        dy = np.random.default_rng(mode + 10).standard_normal(x_shape)
        ms_grads = mindspore_kernels.rpe_backward_ms(dy, x, cos, sin, mode)
        for numpy_grad, ms_grad in zip(rpe_backward(dy, x, cos, sin, mode), ms_grads):
            assert numpy_grad.shape == ms_grad.shape
            np.testing.assert_allclose(numpy_grad, ms_grad, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------- (c) MindSpore forward


@pytest.mark.parametrize("mode", MODES)
def test_mindspore_forward_matches_numpy(mindspore_kernels, mode):
    cases = [
        ((2, 3, 4, 8), (1, 1, 4, 8), np.float32),
        ((5, 1, 8), (5, 1, 8), np.float64),
        ((1, 3, 2, 16), (2, 16), np.float32),
    ]
    for x_shape, cos_shape, dtype in cases:
        x, cos, sin = make_inputs(x_shape, cos_shape, dtype, seed=mode)
        result = mindspore_kernels.rpe_forward_ms(x, cos, sin, mode)
        assert result.dtype == dtype and result.shape == x_shape
        np.testing.assert_allclose(result, rpe_forward(x, cos, sin, mode), **TOLERANCES[np.dtype(dtype)])


def test_mindspore_forward_tensor_on_tensors(mindspore_kernels):
    import mindspore

    x, cos, sin = make_inputs((2, 2, 8), (2, 8), np.float32, seed=3)
    y = mindspore_kernels.rpe_forward_tensor(mindspore.Tensor(x), mindspore.Tensor(cos), mindspore.Tensor(sin), 1)
    assert isinstance(y, mindspore.Tensor)
    np.testing.assert_allclose(y.asnumpy(), reference_forward(x, cos, sin, 1), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- (d) typed errors


def raises_code(error_type, code, *fragments):
    """Context manager: raises error_type with this code, every fragment in the message, a hint."""

    class _Check:
        def __enter__(self):
            self.context = pytest.raises(error_type)
            self.info = self.context.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.context.__exit__(*exc)
            error = self.info.value
            assert error.code == code, str(error)
            for fragment in fragments:
                assert fragment in error.message, (fragment, error.message)
            assert error.hint
            return suppressed

    return _Check()


@pytest.mark.parametrize(
    "mode, shown", [(4, "got 4"), (-1, "got -1"), (True, "got True"), ("sideways", "got 'sideways'"), (1.0, "got 1.0")]
)
def test_invalid_mode(mode, shown):
    x, cos, sin = make_inputs((2, 4), (4,), np.float32, seed=0)
    with raises_code(OpError, "invalid-mode", shown, "0 (half), 1 (interleave), 2 (quarter), 3 (interleave-half)"):
        rpe_forward(x, cos, sin, mode)
    with raises_code(OpError, "invalid-mode", shown):
        rpe_backward(x, x, cos, sin, mode)
    with raises_code(OpError, "invalid-mode", shown):
        rpe_forward_ms(x, cos, sin, mode)  # validated before MindSpore is touched


def test_mode_names_and_numpy_integers_are_accepted():
    assert [normalize_mode(name) for name in ("half", "INTERLEAVE", "quarter", "interleave-half")] == [0, 1, 2, 3]
    assert normalize_mode(np.int64(2)) == 2


@pytest.mark.parametrize(
    "x_shape, mode, fragments",
    [
        ((2, 3, 7), 0, ("D=7", "even", "(2, 3, 7)")),
        ((2, 3, 9), 1, ("D=9", "even")),
        ((2, 3, 6), 2, ("D=6", "a multiple of 4", "mode 2 (quarter)")),
        ((2, 5), 3, ("D=5", "mode 3 (interleave-half)")),
    ],
)
def test_invalid_head_dim(x_shape, mode, fragments):
    x = np.ones(x_shape, np.float32)
    cos = np.ones(x_shape[-1:], np.float32)
    with raises_code(OpError, "invalid-head-dim", *fragments):
        rpe_forward(x, cos, cos, mode)


def test_scalar_x_has_no_head_dim():
    with raises_code(OpError, "invalid-head-dim", "shape ()"):
        rpe_forward(np.float32(1.0), np.ones(2, np.float32), np.ones(2, np.float32))


@pytest.mark.parametrize(
    "x_shape, cos_shape, sin_shape, fragments",
    [
        ((2, 4, 8), (4, 6), (4, 6), ("(4, 6)", "last dim 6", "D=8")),
        ((2, 4, 8), (3, 8), (3, 8), ("(3, 8)", "(2, 4, 8)", "dim -2 is 3, expected 1 or 4")),
        ((2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), ("rank 4", "rank 3")),
        ((2, 4, 8), (4, 8), (1, 8), ("cos shape (4, 8)", "sin shape (1, 8)")),
    ],
)
def test_broadcast_shape_errors(x_shape, cos_shape, sin_shape, fragments):
    x = np.ones(x_shape, np.float32)
    with raises_code(OpError, "broadcast-shape", *fragments):
        rpe_forward(x, np.ones(cos_shape, np.float32), np.ones(sin_shape, np.float32))
    with raises_code(OpError, "broadcast-shape", *fragments):
        rpe_backward(x, x, np.ones(cos_shape, np.float32), np.ones(sin_shape, np.float32))


def test_backward_rejects_dy_of_another_shape():
    x, cos, sin = make_inputs((2, 4, 8), (4, 8), np.float32, seed=0)
    with raises_code(OpError, "broadcast-shape", "dy shape (2, 4, 4)", "x shape (2, 4, 8)"):
        rpe_backward(np.ones((2, 4, 4), np.float32), x, cos, sin)


def test_unsupported_dtype():
    with raises_code(OpError, "unsupported-dtype", "x has dtype int32"):
        rpe_forward(np.ones((2, 4), np.int32), np.ones(4), np.ones(4))


def test_invalid_out():
    x, cos, sin = make_inputs((2, 4, 8), (4, 8), np.float32, seed=0)
    with raises_code(OpError, "invalid-out", "(2, 4, 8)", "float32", "got shape (2, 4, 4)"):
        rpe_forward(x, cos, sin, out=np.empty((2, 4, 4), np.float32))
    with raises_code(OpError, "invalid-out", "must not overlap x"):
        rpe_forward(x, cos, sin, out=x)


# ------------------------------------------------------------------------------ (e) CANN

ACCEPTED = [
    # (x_shape, cos_shape, mode, layout, backward, need_dcos, platform)
    ((2, 4, 16, 64), (1, 1, 16, 64), 0, "BNSD", False, False, "A2"),  # 11SD
    ((2, 4, 16, 64), (2, 1, 16, 64), 0, "BNSD", True, True, "A2"),  # B1SD, B < S
    ((2, 4, 16, 64), (2, 4, 16, 64), 0, "BNSD", True, True, "A3"),  # BNSD
    ((2, 16, 4, 64), (1, 16, 1, 64), 0, "BSND", True, True, "A2"),  # 1S1D
    ((2, 16, 4, 64), (2, 16, 1, 64), 0, "BSND", False, False, "A2"),  # BS1D
    ((16, 2, 4, 64), (16, 2, 1, 64), 0, "SBND", True, True, "A2"),  # SB1D
    ((999, 999, 1, 128), (1, 1, 1, 128), 0, "BNSD", False, False, "A2"),  # B, N < 1000
    ((32, 32, 8, 894), (1, 1, 8, 894), 0, "BNSD", True, True, "A2"),  # B*N = 1024, D = 894
    ((27, 37, 8, 64), (1, 1, 8, 64), 1, "BNSD", True, True, "A2"),  # interleave B*N = 999
    ((2, 16, 4, 64), (1, 16, 1, 64), 1, "BSND", False, False, "A2"),
    ((2, 4, 16, 1024), (1, 1, 1, 1024), 2, "BNSD", False, False, "910_95"),
    ((2, 4, 16, 6), (2, 1, 16, 6), 3, "BNSD", False, False, "910_95"),
    ((20, 20, 16, 64), (1, 1, 16, 64), 0, "BNSD", True, False, "A2"),  # B*N 400 > 8S: advisory only
]


@pytest.mark.parametrize("x_shape, cos_shape, mode, layout, backward, need_dcos, platform", ACCEPTED)
def test_cann_constraints_accept_documented_cases(x_shape, cos_shape, mode, layout, backward, need_dcos, platform):
    advisories = check_cann_constraints(x_shape, cos_shape, mode, layout, backward, need_dcos, platform=platform)
    assert isinstance(advisories, list)


def test_cann_advisories():
    (note,) = check_cann_constraints((20, 20, 16, 64), (1, 1, 16, 64), 0)
    assert "B*N=400 > 8*S=128" in note
    (note,) = check_cann_constraints((2, 4, 16, 50), (1, 1, 16, 50), 0, dtype="float16")
    assert "D=50 (100 bytes" in note
    assert check_cann_constraints((2, 4, 16, 64), (1, 1, 16, 64), 0, dtype="bfloat16") == []


REJECTED = [
    # (x_shape, cos_shape, mode, layout, backward, need_dcos, platform, message fragments)
    ((2, 4, 16, 64), (1, 4, 16, 64), 0, "BNSD", False, False, "A2", ("got cos shape (1, 4, 16, 64)", "11SD (1, 1, 16, 64)", "B1SD (2, 1, 16, 64)")),
    ((2, 4, 16, 64), (2, 1, 16, 64), 1, "BNSD", False, False, "A2", ("mode 1 (interleave)", "11SD (1, 1, 16, 64)")),
    ((2, 16, 4, 64), (1, 1, 16, 64), 0, "BSND", False, False, "A2", ("BSND", "1S1D (1, 16, 1, 64)")),
    ((2, 4, 16, 896), (1, 1, 16, 896), 0, "BNSD", False, False, "A2", ("D < 896", "D=896")),
    ((2, 4, 16, 63), (1, 1, 16, 63), 0, "BNSD", False, False, "A2", ("D even", "D=63")),
    ((1000, 2, 16, 64), (1, 1, 16, 64), 0, "BNSD", False, False, "A2", ("B < 1000", "B=1000")),
    ((2, 1000, 16, 64), (1, 1, 16, 64), 0, "BNSD", False, False, "A2", ("N < 1000", "N=1000")),
    ((25, 40, 16, 64), (1, 1, 16, 64), 1, "BNSD", False, False, "A2", ("B*N < 1000", "25*40=1000")),
    ((25, 41, 16, 64), (1, 1, 16, 64), 0, "BNSD", True, True, "A2", ("B*N <= 1024", "25*41=1025")),
    ((32, 4, 16, 64), (32, 1, 16, 64), 0, "BNSD", True, False, "A2", ("B1SD", "needs B < S", "B=32, S=16")),
    ((4, 2, 16, 64), (1, 1, 16, 64), 2, "BNSD", False, False, "A2", ("mode 2 (quarter)", "910_95")),
    ((4, 2, 16, 64), (1, 1, 16, 64), 3, "BNSD", False, False, "A3", ("mode 3 (interleave-half)", "910_95")),
    ((2, 4, 16, 1028), (1, 1, 1, 1028), 2, "BNSD", False, False, "910_95", ("D <= 1024", "D=1028")),
    ((2, 4, 16, 6), (1, 1, 16, 6), 2, "BNSD", False, False, "910_95", ("D % 4 == 0", "D=6")),
    ((2, 4, 16, 8), (1, 4, 16, 8), 0, "BNSD", False, False, "910_95", ("got cos shape (1, 4, 16, 8)",)),
    ((4, 16, 64), (1, 16, 64), 0, "BNSD", False, False, "A2", ("4-D", "x shape (4, 16, 64)")),
    ((2, 4, 16, 64), (1, 1, 16, 64), 0, "BHSD", False, False, "A2", ("'BHSD'", "BNSD, BSND, SBND")),
]


@pytest.mark.parametrize("x_shape, cos_shape, mode, layout, backward, need_dcos, platform, fragments", REJECTED)
def test_cann_constraints_reject_documented_cases(x_shape, cos_shape, mode, layout, backward, need_dcos, platform, fragments):
    with raises_code(ExecutionError, "kernel-constraint", *fragments):
        check_cann_constraints(x_shape, cos_shape, mode, layout, backward, need_dcos, platform=platform)


def test_cann_constraints_reject_float64():
    with raises_code(ExecutionError, "kernel-constraint", "float64"):
        check_cann_constraints((2, 4, 16, 64), (1, 1, 16, 64), 0, dtype=np.float64)


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("platform", ["A2", "910_95"])
def test_cann_has_no_backward_for_quarter_and_interleave_half(mode, platform):
    with raises_code(ExecutionError, "no-backward-kernel", f"mode {mode}", "(2, 4, 16, 64)"):
        check_cann_constraints((2, 4, 16, 64), (1, 1, 16, 64), mode, backward=True, platform=platform)


def test_cann_constraint_argument_errors():
    with raises_code(OpError, "invalid-platform", "'910B'"):
        check_cann_constraints((2, 4, 16, 64), (1, 1, 16, 64), 0, platform="910B")
    with raises_code(OpError, "invalid-mode", "got 5"):
        check_cann_constraints((2, 4, 16, 64), (1, 1, 16, 64), 5)


def test_cann_available_is_false_off_ascend():
    available = cann_available()
    assert isinstance(available, bool)
    try:
        import mindspore
    except ImportError:
        assert available is False
        return
    if mindspore.get_context("device_target") != "Ascend":
        assert available is False


def test_missing_mindspore_is_a_typed_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mindspore", None)  # makes ``import mindspore`` fail
    x, cos, sin = make_inputs((2, 4), (4,), np.float32, seed=0)
    with raises_code(ExecutionError, "backend-unavailable", "MindSpore cannot be imported"):
        rpe_forward_ms(x, cos, sin, 0)
    assert cann_available() is False
    with raises_code(ExecutionError, "backend-unavailable", "no Ascend device"):
        rpe_cann.rpe_forward_cann(x, cos, sin, 0)


@pytest.mark.skipif(cann_available(), reason="an Ascend device is present")
def test_cann_kernels_report_backend_unavailable():
    x, cos, sin = make_inputs((1, 2, 4, 8), (1, 1, 4, 8), np.float32, seed=0)
    for call in (lambda: rpe_cann.rpe_forward_cann(x, cos, sin, 0), lambda: rpe_cann.rpe_backward_cann(x, x, cos, sin, 0)):
        with raises_code(ExecutionError, "backend-unavailable", "no Ascend device") as info:
            call()
        assert "\n" not in str(info.value)


@pytest.mark.skipif(not cann_available(), reason=NO_ASCEND)
@pytest.mark.parametrize("mode", [0, 1])
def test_cann_forward_matches_numpy(mode):
    x, cos, sin = make_inputs((2, 4, 16, 64), (1, 1, 16, 64), np.float32, seed=mode)
    np.testing.assert_allclose(rpe_cann.rpe_forward_cann(x, cos, sin, mode), reference_forward(x, cos, sin, mode), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cann_available(), reason=NO_ASCEND)
@pytest.mark.parametrize("mode", [0, 1])
def test_cann_backward_matches_numpy(mode):
    x, cos, sin = make_inputs((2, 4, 16, 64), (1, 1, 16, 64), np.float32, seed=mode)
    dy = np.random.default_rng(mode).standard_normal(x.shape).astype(np.float32)
    for cann_grad, numpy_grad in zip(rpe_cann.rpe_backward_cann(dy, x, cos, sin, mode), rpe_backward(dy, x, cos, sin, mode)):
        np.testing.assert_allclose(cann_grad, numpy_grad, rtol=1e-4, atol=1e-4)
    dx, dcos, dsin = rpe_cann.rpe_backward_cann(dy, x, cos, sin, mode, need_dcos=False)
    assert dcos is None and dsin is None
    np.testing.assert_allclose(dx, rpe_backward(dy, x, cos, sin, mode)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", MODES)
def test_rotate_of_one_element_pieces_on_a_3d_array(mode, dtype):
    """Pieces one element wide on a (1, 2, D) array: numpy 2.4's float32 ``negative`` with a
    strided ``out`` read such a column as if it were contiguous (the reference path used it)."""
    x = np.arange(1.0, 9.0, dtype=dtype).reshape(1, 2, 4)
    np.testing.assert_array_equal(rotate(x, mode), rotate_by_index(x, mode))
    np.testing.assert_array_equal(rpe_forward_reference(x, np.zeros(4), np.ones(4), mode), rotate_by_index(x, mode))
