"""The loader's checks made at once over all nodes agree with its node-by-node checks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.io import loader
from layout_prop.core.errors import LayoutPropError

_names = st.sampled_from(["x", "y", "a", "b.c", "d-1", "", "e f", "g:1", "h\n", "a\nb", "x" * 300, 7, None])
_ops = st.sampled_from(["add", "mul", "relu", "no_such_op", 3])
_inputs = st.one_of(st.lists(st.sampled_from(["x", "y", "a", "b.c", "w", 5]), max_size=3), st.just("x"))
_attrs = st.one_of(st.none(), st.just({}), st.just({"bogus": 1}), st.just([1]))


@st.composite
def _node(draw):
    node = {"name": draw(_names), "op": draw(_ops), "inputs": draw(_inputs)}
    if draw(st.booleans()):
        node["attrs"] = draw(_attrs)
    if draw(st.integers(0, 9)) == 0:
        node["extra"] = 1
    if draw(st.integers(0, 9)) == 0:
        del node["name"]
    return node if draw(st.integers(0, 19)) else ["not", "a", "mapping"]


def _outcome(data, defined):
    try:
        nodes, in_order = loader._nodes(data, set(defined))
    except LayoutPropError as err:
        return ("error", err.code, err.path)
    return ("ok", in_order, [(i, n.name, n.op, n.inputs, n.attrs, n.num_outputs) for i, n in nodes])


@settings(max_examples=500, deadline=None)
@given(st.lists(_node(), max_size=6), st.sampled_from([("x",), ("x", "w"), ("a",)]))
def test_bulk_checks_agree_with_node_by_node_checks(data, defined):
    bulk = _outcome(data, defined)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loader, "_keys_and_names_fine", lambda data, defined: False)
        one_by_one = _outcome(data, defined)
    assert bulk == one_by_one


def test_bulk_checks_pass_on_a_plain_spec_and_refuse_each_mistake():
    good = [{"name": "y", "op": "add", "inputs": ["x", "x"]}, {"name": "z.1", "op": "relu", "inputs": ["y"]}]
    assert loader._keys_and_names_fine(good, {"x"})
    for bad in ([{"name": "y", "op": "add", "extra": 1}], [{"op": "add"}], [{"name": "y"}], [[1]],
                [{"name": "g:1", "op": "add"}], [{"name": "y", "op": "add"}, {"name": "y", "op": "add"}],
                [{"name": "x", "op": "add"}], [{"name": "a" * 300, "op": "add"}], [{"name": 3, "op": "add"}],
                [{"name": "", "op": "add"}], [{"name": "a\nb", "op": "add"}]):
        assert not loader._keys_and_names_fine(bad, {"x"}), bad
