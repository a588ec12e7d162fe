"""The line reader of plain block YAML gives exactly what PyYAML's loader gives, or None."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from layout_prop.io import loader
from layout_prop.io.block_yaml import read_block_yaml
from layout_prop.cli import main
from layout_prop.frontends.generate import llama_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def read(text: str):
    ld = loader._UniqueKeyLoader("")
    try:
        return read_block_yaml(text, lambda plain: loader._plain_scalar(ld, plain))
    finally:
        ld.dispose()


def load(text: str):
    """What the loader reads: ("ok", value) or ("error", the exception's class)."""
    try:
        return "ok", yaml.load(text, Loader=loader._UniqueKeyLoader)
    except Exception as exc:  # noqa: BLE001 - whatever the loader does
        return "error", type(exc).__name__


def agrees(text: str) -> bool:
    """The reader gives the loader's value (same types: 1 is not True) or None; whether it read."""
    got = read(text)
    if got is None:
        return False
    expected = load(text)
    assert expected == ("ok", got), text
    assert repr(got) == repr(expected[1]), text
    return True


# scalars the loader resolves in surprising ways (YAML 1.1) and scalars it must quote
_SCALARS = ["yes", "No", "on", "OFF", "y", "n", "~", "null", "Null", "true", "False", "0x1F", "0o17", "017", "0b101",
            "1_000", "1e-6", "2E+3", "1.0e-06", "+1", "-1", "-0", "+.5", "-.inf", "2001-12-14", "S(0)", "P(sum)",
            "_S(1,2)", "a-b", "x/y", "f(x)", "~x", "-x", "--", "-", "a b", "a:b", "1:30", ".5", "=", "<<", "", "#",
            "é"]
_plain = st.one_of(st.sampled_from(_SCALARS), st.text(string.ascii_letters + string.digits + "_-.()", max_size=6))
_keys = st.one_of(_plain, st.integers(-3, 3), st.booleans())
_leaf = st.one_of(_plain, st.integers(), st.floats(allow_nan=False), st.booleans(), st.none())
_values = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(_keys, inner, max_size=3)), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_keys, _values, min_size=1, max_size=4), st.sampled_from([None, False]),
       st.sampled_from([2, 4]), st.booleans())
def test_dumped_values_read_as_the_loader_reads_them(value, flow, indent, sort_keys):
    text = yaml.safe_dump(value, default_flow_style=flow, indent=indent, sort_keys=sort_keys, width=10**6)
    agrees(text)


_names = st.text(string.ascii_letters + "_", min_size=1, max_size=5).filter(lambda s: s.lower() not in (
    "y", "n", "yes", "no", "on", "off", "true", "false", "null"))
_safe_leaf = st.one_of(_names, st.integers(-10**6, 10**6), st.booleans(), st.none())
_safe_values = st.recursive(
    _safe_leaf, lambda inner: st.one_of(st.lists(_safe_leaf, max_size=3), st.dictionaries(_names, inner, max_size=3),
                                        st.lists(st.dictionaries(_names, inner, min_size=1, max_size=2), max_size=2)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_names, _safe_values, min_size=1, max_size=4), st.sampled_from([None, False]))
def test_specs_shaped_like_gen_output_are_read_here(value, flow):
    # plain names, numbers, booleans and nulls, lists of scalars or of mappings, as gen writes
    # them with default_flow_style None (flow leaves) or False (all block): read here, not deferred
    # (under a key: a root of scalars only would be dumped as one flow mapping)
    text = yaml.safe_dump({"spec": value, "mesh": {"shape": [2]}}, default_flow_style=flow, sort_keys=False,
                          width=10**6)
    assert agrees(text), text


_words = st.sampled_from(["a", "b", "k", "x1", "S(0)", "-1", "1", "2.5", "1e-6", "yes", "no", "~", "null", "0x1F",
                           "a-b", "_", "-", "a b", "#x", "'q'", "[x]", "a:b", "2001-12-14", "", "k" * 1025])
_trees = st.recursive(_words, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.lists(st.tuples(_words, inner), max_size=3)), max_leaves=10)


def _emit(tree, lines: list[str], pad: int, step: int, at_key: bool, flow: bool, space: str) -> None:
    """Block YAML lines of ``tree`` (a word, a list, or a list of (key, value) pairs, keys
    possibly repeated) written the ways people and yaml.dump write it, not always valid."""
    def leaf(value) -> str | None:
        if isinstance(value, str):
            return value
        if flow and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return "[" + ", ".join(value) + "]"
        if flow and isinstance(value, list) and all(isinstance(v, tuple) and isinstance(v[1], str) for v in value):
            return "{" + ", ".join(f"{k}: {v}" for k, v in value) + "}"
        return None

    pairs = isinstance(tree, list) and tree and all(isinstance(v, tuple) for v in tree)
    items = tree if isinstance(tree, list) else [tree]
    for item in items:
        if pairs:
            key, value = item
            text = leaf(value)
            if text is not None:
                lines.append(f"{' ' * pad}{key}:{space}{text}".rstrip() if text else f"{' ' * pad}{key}:")
            else:
                lines.append(f"{' ' * pad}{key}:")
                _emit(value, lines, pad if at_key and not (value and isinstance(value[0], tuple)) else pad + step,
                      step, at_key, flow, space)
        else:
            text = leaf(item)
            if text is not None:
                lines.append(f"{' ' * pad}- {text}".rstrip())
            else:
                sub: list[str] = []
                _emit(item, sub, pad + 2, step, at_key, flow, space)
                if sub:
                    sub[0] = f"{' ' * pad}- {sub[0].lstrip()}"
                lines.extend(sub or [f"{' ' * pad}-"])


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(_words, _trees), min_size=1, max_size=4), st.sampled_from([2, 4, 3]), st.booleans(),
       st.booleans(), st.sampled_from([" ", "  "]), st.integers(0, 60), st.sampled_from(["", " ", "  ", " # c", "x"]))
def test_written_blocks_read_as_the_loader_reads_them_or_are_deferred(tree, step, at_key, flow, space, where, change):
    lines: list[str] = []
    _emit(tree, lines, 0, step, at_key, flow, space)
    if change and lines:  # a line indented otherwise, or with a comment or a stray character
        k = where % len(lines)
        lines[k] = change + lines[k] if not change.strip() else lines[k] + change  # spaces go in front
    agrees("\n".join(lines) + "\n")


@pytest.mark.parametrize("text", ["a: 1 # c\n", "a: 'x'\n", "a: 1\na: 2\n", "a: {k: 1, k: 2}\n", "a: -\n",
                                  "a:\n\t- x\n", "a: 1\r\nb: 2\r\n", "", "\n\n", "- a\n", "a: x\n  y\n", "a: 1 \n",
                                  "a: [1, [2]]\n", "a: &x 1\nb: *x\n", "---\na: 1\n", "a: 1\n...\n", "  a: 1\n",
                                  "a:\n  - x\n  b: 1\n", "a: |\n  x\n", "a:\n  y\n", "1: a\ntrue: b\n",
                                  "a: 99" + "9" * 5000 + "\n"])
def test_what_the_reader_leaves_to_the_loader(text):
    assert read(text) is None


@pytest.mark.parametrize("length", [1, 1023, 1024, 1025, 5000])
@pytest.mark.parametrize("form", ["{k}: 1\n", "a: {{{k}: 1}}\n", "a:\n- {k}: 1\n", "a: [{k}]\n", "a: {k}\n"],
                         ids=["key", "flow-key", "entry-key", "flow-item", "value"])
def test_keys_past_libyamls_length_are_left_to_the_loader(form, length):
    # libyaml reads an implicit key of at most 1,024 characters (a longer one is an error there)
    text = form.format(k="k" * length)
    read_here = agrees(text)
    assert read_here == (length <= 1024 or "{k}:" not in form), (form, length)


@pytest.mark.parametrize("depth", [10, 499, 500, 998, 999, 1200])
def test_deep_nesting_is_left_to_the_loader_before_libyaml_refuses_it(depth):
    text = "".join(" " * i + f"k{i}:\n" for i in range(depth))
    assert agrees(text) == (depth <= 500)


def test_sequences_at_their_keys_column_and_nested_entries():
    text = "a:\n- x\n- k: 1\n  l:\n  - 2\n  m: {}\nb:\n  c: [1, y]\nd:\n"
    assert agrees(text)
    assert read(text) == {"a": ["x", {"k": 1, "l": [2], "m": {}}], "b": {"c": [1, "y"]}, "d": None}


def test_generated_and_example_specs_are_read_here_and_as_the_loader_reads_them(capsys):
    assert main(["gen", "llama", "--layers", "2"]) == 0
    generated = capsys.readouterr().out
    assert agrees(generated)
    assert read(generated) == llama_spec(2)
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        agrees(path.read_text())  # hand-written examples (comments, quotes) may be deferred


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_keys, _values, min_size=1, max_size=4))
def test_what_dump_yaml_writes_reads_back_equal(value):
    """gen, import and plan write specs with ``dump_yaml``: whatever they hold (names such as
    ``1e3``, which PyYAML's own dumper left unquoted and this loader reads as 1000.0) reads back
    as it was, by the line reader or the loader."""
    text = loader.dump_yaml(value)
    back = loader.parse_spec(text)
    assert back == value and repr(back) == repr(value), text


def test_import_and_plan_names_that_look_like_numbers_load_again(tmp_path):
    spec = {"mesh": {"shape": [2], "names": ["dp"]}, "inputs": {"1e3": {"shape": [4, 8]}},
            "nodes": [{"name": "2E5", "op": "relu", "inputs": ["1e3"]}], "outputs": ["2E5"]}
    path = tmp_path / "names.yaml"
    path.write_text(loader.dump_yaml(spec))
    assert [n.name for n in loader.load_spec(path).nodes] == ["1e3", "2E5"]
