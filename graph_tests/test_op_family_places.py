"""An op family is added in four places, the registration lists derived (issue 37):

1. its rule module in ``ops/`` (the rule, its cost class, its documentation),
2. its numpy kernel module ``kernels/<family>_numpy.py``,
3. its MindSpore kernel module ``kernels/<family>_mindspore.py``,
4. its samples ``layout_prop/testing/opdb/<family>.py``.

Shown by a toy family, ``toy_axpy`` (``a * x + y``, elementwise and linear in each
operand), written into four temporary modules that the packages' own discovery finds:
the ops package's ``family_modules``, the kernels' ``family_tables`` and the op
database's ``all_records``.  The generic op test (``test_opdb``'s body) then checks it
forward and backward on sharded meshes against one device, ``estimate`` prices it from the
rule's declared cost, and the MindSpore kernel is compared with the numpy one on the
samples (``graph_tests/kernel_samples`` takes them from the records).  The registry and kernel tables are restored afterwards.
"""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest

import layout_prop.kernels as kernels_pkg
import layout_prop.ops as ops_pkg
import layout_prop.testing.opdb as opdb_pkg
from layout_prop.core import registry
from layout_prop.kernels import numpy_backend
from layout_prop.perf.costs import cost_class, op_cost
from layout_prop.testing import verify_op
from layout_prop.testing.opdb import all_records

RULE = '''
"""A toy family: toy_axpy(x, y, a=2.0) = a * x + y."""
from layout_prop.core.registry import register_op
from layout_prop.ops.elementwise import ElementwiseRule


@register_op
class ToyAxpy(ElementwiseRule):
    """``toy_axpy(x, y, a=2.0)``: ``a * x + y``, elementwise (linear in each operand)."""

    name = "toy_axpy"
    operands = ("x", "y")
    attr_defaults = {"a": 2.0}
    cost_kind = "vector"
    vector_flops = 2

    def vjp(self, g, inputs, outputs, cotangents, attrs, needs):
        dy = cotangents[0]
        if dy is None:
            return (None, None)
        dx = g.op("scale", [dy], {"factor": attrs["a"]}) if needs[0] else None
        return (g.op("sum_to", [dx], {"shape": list(g.spec(inputs[0]).shape)}) if dx is not None else None,
                g.op("sum_to", [dy], {"shape": list(g.spec(inputs[1]).shape)}) if needs[1] else None)
'''

NUMPY_KERNEL = '''
import numpy as np


def toy_axpy(x, y, a=2.0):
    return (a * np.asarray(x) + np.asarray(y)).astype(np.result_type(x, y))


KERNELS = {"toy_axpy": toy_axpy}
'''

MINDSPORE_KERNEL = '''
def toy_axpy(x, y, a=2.0):
    from layout_prop.kernels.mindspore_backend import to_tensor

    return to_tensor(x) * a + to_tensor(y)


KERNELS = {"toy_axpy": toy_axpy}
'''

SAMPLES = '''
from layout_prop.testing.opdb import OpRecord, OpSample

RECORDS = [OpRecord("toy_axpy", [OpSample([(4, 3), (4, 3)], {"a": 1.5}), OpSample([(5, 2), (2,)])],
                    meshes=((2,), (2, 2)), placements=12, id="toy-axpy")]
'''


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The toy family's four modules, each in a directory its package searches."""
    places = {ops_pkg: ("toy_family", RULE), kernels_pkg: ("toy_family_numpy", NUMPY_KERNEL),
              opdb_pkg: ("toy_family", SAMPLES)}
    for package, (module, text) in places.items():
        folder = tmp_path / package.__name__
        folder.mkdir()
        (folder / f"{module}.py").write_text(textwrap.dedent(text))
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    (tmp_path / kernels_pkg.__name__ / "toy_family_mindspore.py").write_text(textwrap.dedent(MINDSPORE_KERNEL))
    # the registry as it was (the toy op's registration is undone)
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))
    monkeypatch.setattr(registry, "_VARIADIC", {"names": None})
    yield
    for name in ("layout_prop.ops.toy_family", "layout_prop.kernels.toy_family_numpy",
                 "layout_prop.kernels.toy_family_mindspore", "layout_prop.testing.opdb.toy_family"):
        sys.modules.pop(name, None)


def test_a_family_in_four_places_is_found_registered_and_verified(toy_family, monkeypatch):
    # 1. the rule module: the ops package's discovery imports it, which registers the op
    assert "toy_family" in ops_pkg.family_modules()
    ops_pkg.load_families()
    rule = registry.get_rule("toy_axpy")
    # 2. its numpy kernel module: found by name, its table merged as the backend merges every family's
    tables = [t for t in kernels_pkg.family_tables("numpy") if "toy_axpy" in t]
    assert len(tables) == 1
    for op, fn in tables[0].items():
        monkeypatch.setitem(numpy_backend.KERNELS, op, fn)
    # 4. its samples: the op database finds the record, and the generic op test's body checks it
    records = [r for r in all_records() if r.op == "toy_axpy"]
    assert [r.name for r in records] == ["toy-axpy"]
    record = records[0]
    report = verify_op(record.op, record.samples, meshes=record.meshes, placements=record.placements,
                       backward=record.backward, codes=record.codes, seed=len(record.name))
    assert report.ok, report.to_dict()
    assert report.accepted > 0 and report.combinations > 20  # sharded combinations ran and matched one device
    # its cost is declared beside the rule: no perf table to extend
    assert cost_class("toy_axpy") == "vector"
    assert op_cost("toy_axpy", ((4, 3), (4, 3)), ((4, 3),), (4, 4), (4,), {}).flops == 2 * 12
    assert rule.name == "toy_axpy"


def test_the_mindspore_kernel_module_is_found_and_matches_numpy(toy_family):
    # test_msrun's comparison of every MindSpore kernel with numpy takes the toy op's samples from its records
    pytest.importorskip("mindspore")
    from layout_prop.kernels.mindspore_backend import to_numpy

    from .kernel_samples import family_samples

    ops_pkg.load_families()
    (ms_table,) = [t for t in kernels_pkg.family_tables("mindspore") if "toy_axpy" in t]
    (np_table,) = [t for t in kernels_pkg.family_tables("numpy") if "toy_axpy" in t]
    rng = np.random.default_rng(0)
    cases = family_samples(rng, lambda *shape: rng.standard_normal(shape).astype(np.float32))["toy_axpy"]
    assert [[a.shape for a in args] for args, _ in cases] == [[(4, 3), (4, 3)], [(5, 2), (2,)]]
    for args, attrs in cases:
        np.testing.assert_allclose(to_numpy(ms_table["toy_axpy"](*args, **attrs)), np_table["toy_axpy"](*args, **attrs),
                                   rtol=1e-6)


def test_the_built_in_lists_are_the_discovered_modules():
    # every op module but the helpers is a family; every *_numpy module with a table is merged
    assert set(ops_pkg.family_modules()) == {"attention", "copying", "elementwise", "index", "linalg", "loss", "moe",
                                             "nn", "order", "redistribute", "ring", "rpe", "shape"}
    merged = {}
    for table in kernels_pkg.family_tables("numpy"):
        merged.update(table)
    assert set(merged) <= set(numpy_backend.KERNELS)
    assert {"gather", "topk", "stack", "cross_entropy_parts", "moe_dispatch", "reshape", "softmax"} <= set(merged)
    assert importlib.import_module("layout_prop.ops").LOADED
