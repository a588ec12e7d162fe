"""YAML specs read from libyaml's events give exactly what PyYAML's loader gives, or defer to it."""

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.io import loader

# scalars YAML 1.1 resolves in surprising ways, and the constructs the fast reader leaves to the loader
_TRICKY = ["yes", "No", "on", "OFF", "~", "null", "", "0x1F", "0o17", "017", "1_000", "1:30", "-1:30:00", "1e-6",
           "2E+3", ".5", "+.inf", "-.Inf", ".nan", "2001-12-14", "2001-12-14t21:59:43.10-05:00", "'1'", '"2"',
           "'a: b'", '"x\\ty"', "=", "<<", "!!str 3", "!!set {a, b}", "!!binary aGk=", "!foo x", "&a 1", "*a",
           "[1, *a]", "{<<: {a: 1}}", "{a: 1, a: 2}", "{1: a, true: b}", "{[1]: 2}", "? [1]\n  : 2", "|\n    block",
           ">\n    folded", "S(0)", "P(sum)", "[R, S(-1)]", "x" * 5000, "1" * 5000, "{a: {b: {c: [d]}}}",
           "- 1\n  - 2", "a: b: c", "'unterminated", "[1, 2", "\t x", "%", "@x", "`x", "0b101", "1.0e+3", "-0"]

_leaf = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.booleans(), st.none())
_values = st.recursive(_leaf, lambda children: st.one_of(st.lists(children, max_size=3),
                                                         st.dictionaries(st.text(max_size=4), children, max_size=3)),
                       max_leaves=10)


def _slow(text):
    try:
        return "ok", repr(yaml.load(text, Loader=loader._UniqueKeyLoader))
    except Exception as exc:  # noqa: BLE001 - what the loader does, whatever it is
        return "error", type(exc).__name__


def _agrees(text):
    fast = loader._parse_yaml_fast(text)
    if fast is loader._MISSING:
        return True
    assert ("ok", repr(fast)) == _slow(text), text
    return False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_TRICKY), min_size=1, max_size=4), st.booleans())
def test_tricky_scalars_and_constructs_read_as_the_loader_reads_them(fragments, in_list):
    if in_list:
        text = "".join(f"- {f}\n" for f in fragments)
    else:
        text = "".join(f"k{i}: {f}\n" for i, f in enumerate(fragments))
    _agrees(text)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _values, max_size=5), st.sampled_from([None, True, False]),
       st.booleans())
def test_dumped_values_read_back_as_the_loader_reads_them(value, flow, explicit_start):
    _agrees(yaml.safe_dump(value, default_flow_style=flow, explicit_start=explicit_start, allow_unicode=True))


def test_the_common_spec_is_read_fast_and_the_rest_deferred():
    spec = "mesh: {shape: [2], names: [dp]}\ninputs:\n  x: {shape: [4], placements: ['S(0)']}\nnodes: []\n"
    assert loader._parse_yaml_fast(spec) == yaml.load(spec, Loader=loader._UniqueKeyLoader)
    for deferred in ("a: &x [1]\nb: *x\n", "a: !!set {b}\n", "a: 1\na: 2\n", "<<: {a: 1}\n", "? [1]\n: 2\n",
                     "--- 1\n--- 2\n", "a: [1\n", ""):
        assert loader._parse_yaml_fast(deferred) is loader._MISSING, deferred
