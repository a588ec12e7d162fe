"""JSON specs: keys written twice are refused wherever they are, and only then."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.core.errors import SpecError
from layout_prop.io.loader import parse_spec

# keys and strings with colons in them, written plainly or escaped (\u003a), so that the count
# of ':' in the text differs from the count of pairs
_text = st.text(alphabet="ab:", max_size=3)
_leaf = st.one_of(st.integers(-5, 5), _text, st.booleans(), st.none())


def _objects(children):
    return st.one_of(st.lists(children, max_size=3).map(lambda items: ("list", items)),
                     st.lists(st.tuples(_text, children), max_size=4).map(lambda pairs: ("object", pairs)))


_values = st.recursive(_leaf, _objects, max_leaves=12)


def _write(value, escape: bool) -> str:
    if isinstance(value, tuple) and value[0] == "list":
        return "[" + ", ".join(_write(v, escape) for v in value[1]) + "]"
    if isinstance(value, tuple):
        return "{" + ", ".join(f"{_write(k, escape)}: {_write(v, escape)}" for k, v in value[1]) + "}"
    text = json.dumps(value)
    return text.replace(":", "\\u003a") if escape and isinstance(value, str) else text


def _has_duplicate(value) -> bool:
    if isinstance(value, tuple) and value[0] == "list":
        return any(_has_duplicate(v) for v in value[1])
    if isinstance(value, tuple):
        keys = [k for k, _ in value[1]]
        return len(set(keys)) != len(keys) or any(_has_duplicate(v) for _, v in value[1])
    return False


def _python(value):
    if isinstance(value, tuple) and value[0] == "list":
        return [_python(v) for v in value[1]]
    if isinstance(value, tuple):
        return {k: _python(v) for k, v in value[1]}
    return value


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_text, _values), min_size=1, max_size=4), st.booleans())
def test_a_key_written_twice_is_refused_anywhere_and_only_then(pairs, escape):
    top = ("object", pairs)
    text = _write(top, escape)
    if _has_duplicate(top):
        with pytest.raises(SpecError) as err:
            parse_spec(text)
        assert err.value.code == "spec-syntax" and "twice" in str(err.value)
    else:
        assert parse_spec(text) == _python(top)


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_the_depth_limit_is_the_same_for_json_and_yaml(fmt):
    """The top mapping is level 1: lists nested MAX_DEPTH - 1 deep under it are read, one more is not."""
    from layout_prop.io.loader import MAX_DEPTH

    def text(lists):
        nested = "[" * lists + "]" * lists
        return f'{{"a": {nested}}}' if fmt == "json" else f"a: {nested}\n"

    assert parse_spec(text(MAX_DEPTH - 1))["a"] is not None
    with pytest.raises(SpecError) as err:
        parse_spec(text(MAX_DEPTH))
    assert err.value.code == "spec-too-deep"
