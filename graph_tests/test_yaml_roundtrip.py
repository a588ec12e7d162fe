"""A spec written as YAML reads back the same, whichever emitter writes it.

``dump_yaml`` writes through libyaml's emitter (``yaml.CSafeDumper``) where PyYAML has it;
the quoting is still decided by the resolvers of :mod:`layout_prop.io.loader`, so that a
string the loader would read as a number, a boolean or null ("1e3", "yes", "null", "0x10")
is quoted.  Each spec is read back by every reader ``parse_spec`` may use: the line reader of
block YAML, libyaml's events and the full loader.
"""

from __future__ import annotations

import pytest
import yaml

from layout_prop.io import loader
from layout_prop.io.loader import dump_yaml, format_spec, load_spec, parse_spec

#: strings YAML 1.1 or the loader's float pattern would read as something else, and YAML syntax
TRICKY = ["S(0)", "R", "P(sum)", "yes", "no", "on", "off", "Yes", "NO", "y", "n", "true", "False", "1e3", "2E+5",
          "-1e-6", "null", "Null", "~", "0x10", "0o7", "017", "1_000", "1:20", "12:30:45", ".5", "-.inf", ".NaN",
          "+1", "2001-12-14", "=", "<<", "- x", "a: b", "#c", "x #y", "'q'", '"d"', "&a", "*a", "!t", "%p", "@x",
          "`b", "[1]", "{a}", "a,b", "?", " lead", "trail ", "multi\nline", "tab\there", "\u00fcn\u00ef", "1.0", "1",
          "-0", "3.", "0b101", "|", ">", ""]

#: names a spec accepts that look like numbers, booleans or null to YAML
NAMES = ["yes", "no", "on", "off", "true", "null", "1e3", "2E5", "123", "0x10", "1_000", "017", "1.5", "-1", "n", "y"]


def _readers(text: str) -> list:
    """The spec read by parse_spec, by the full YAML loader, and by PyYAML's own safe loader."""
    return [parse_spec(text), loader._parse_yaml(text, "<test>"),
            yaml.load(text, Loader=loader._UniqueKeyLoader)]


def _spec_with_names(names: list[str]) -> dict:
    nodes, last = [], "x"
    for name in names:
        nodes.append({"name": name, "op": "scale", "inputs": [last], "attrs": {"factor": 2.0}})
        last = name
    return {"mesh": {"shape": [2], "names": ["dp"]},
            "inputs": {"x": {"shape": [4, 8], "dtype": "float32", "placements": ["S(0)"]}},
            "nodes": nodes, "outputs": [last]}


def test_tricky_strings_read_back_as_strings():
    data = {"values": TRICKY, "mapping": {text: text for text in TRICKY}, "nested": [{"k": [text]} for text in TRICKY]}
    text = dump_yaml(data)
    for read in _readers(text):
        assert read == data


def test_keys_that_look_like_numbers_stay_strings():
    data = {"inputs": {"1e3": {"shape": [4]}, "123": {"shape": [1]}, "0x10": {"shape": [2]}, "true": {"shape": [3]},
                       "null": {"shape": [5]}}}
    text = dump_yaml(data)
    for read in _readers(text):
        assert read == data
        assert all(isinstance(key, str) for key in read["inputs"])


def test_numbers_stay_numbers():
    data = {"attrs": {"eps": 1e-06, "big": 1e300, "tiny": 5e-324, "neg": -0.0, "int": 10 ** 18, "mode": 0, "on": True,
                      "off": False, "none": None, "float_int": 3.0}}
    for read in _readers(dump_yaml(data)):
        assert read == data
        assert [type(v) for v in read["attrs"].values()] == [type(v) for v in data["attrs"].values()]


@pytest.mark.parametrize("length", [len(NAMES), 3000])  # a long spec takes the line reader of block YAML
def test_a_spec_with_such_names_loads_back_the_same(length):
    names = (NAMES * (length // len(NAMES) + 1))[:length]
    names = [f"{name}" if i < len(NAMES) else f"{name}_{i}" for i, name in enumerate(names)]
    spec = _spec_with_names(names)
    text = dump_yaml(spec)
    assert parse_spec(text) == spec
    graph = load_spec(parse_spec(text))
    assert [n.name for n in graph.nodes if not n.is_input] == names
    assert format_spec(parse_spec(text)) == text  # written again, the same text


def test_the_emitter_is_libyamls_where_pyyaml_has_it():
    if not hasattr(yaml, "CSafeDumper"):
        pytest.skip("PyYAML was built without libyaml")
    assert issubclass(loader._SpecDumper, yaml.CSafeDumper)


class _PlainEmitter(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """PyYAML's own representer and emitter with the loader's resolvers: the reference text."""

    def ignore_aliases(self, data):
        return True


_PlainEmitter.add_implicit_resolver("tag:yaml.org,2002:float", loader._EXPONENT_FLOAT, list("-+0123456789"))


def _reference(data) -> str:
    return yaml.dump(data, Dumper=_PlainEmitter, sort_keys=False, default_flow_style=None, width=120)


def _random_spec(rng) -> dict:
    """A spec-like mapping: plain and tricky names, long input lists (lines past 120 columns),
    attrs of every scalar type, nested lists and mappings, empty collections."""
    def name():
        return rng.choice(TRICKY) if rng.random() < 0.05 else f"v{rng.randrange(10 ** rng.randrange(1, 30))}"

    def scalar():
        return rng.choice([name(), rng.randrange(-10 ** 6, 10 ** 6), rng.random() * 10 ** rng.randrange(-30, 30),
                           True, False, None, -0.0, float("inf"), 1e-06, "S(0)", "P(sum)", "float32"])

    def attr(depth=0):
        r = rng.random()
        if depth > 2 or r < 0.6:
            return scalar()
        if r < 0.85:
            return [attr(depth + 1) for _ in range(rng.randrange(0, 40 if rng.random() < 0.1 else 4))]
        return {name() if rng.random() < 0.3 else rng.choice(["shape", "dims", "axis", "eps"]): attr(depth + 1)
                for _ in range(rng.randrange(0, 4))}

    inputs = {name(): {"shape": [rng.randrange(1, 9) for _ in range(rng.randrange(0, 4))],
                       "placements": [rng.choice(["R", "S(0)", "S(1)", "P"]) for _ in range(2)],
                       **({"dtype": "float32"} if rng.random() < 0.5 else {})} for _ in range(rng.randrange(1, 4))}
    nodes = []
    for _ in range(rng.randrange(0, 12)):
        node = {"name": name(), "op": rng.choice(["relu", "matmul", "concat", "yes", "reshape"]),
                "inputs": [name() for _ in range(rng.randrange(0, 30 if rng.random() < 0.2 else 3))]}
        if rng.random() < 0.6:
            node["attrs"] = {rng.choice(["shape", "dims", "eps", "mode", "1e3", "null"]): attr()
                             for _ in range(rng.randrange(0, 3))}
        nodes.append(node)
    spec = {"mesh": {"shape": [2, 2], "names": ["dp", "tp"]}, "inputs": inputs, "nodes": nodes,
            "outputs": [name() for _ in range(rng.randrange(1, 3 if rng.random() < 0.8 else 40))]}
    if rng.random() < 0.2:
        spec[rng.choice(TRICKY)] = attr()
    return spec


def test_the_block_writer_writes_what_the_emitter_writes():
    import random

    rng = random.Random(27)
    fast = 0
    for _ in range(400):
        spec = _random_spec(rng)
        text = dump_yaml(spec)
        assert text == _reference(spec)
        assert parse_spec(text) == spec
        fast += loader._BlockWriter().write(spec) is not None
    assert fast > 200  # most specs are written by the block writer (the rest fall back to the emitter)


def test_generated_and_imported_specs_are_written_by_the_block_writer():
    from layout_prop.frontends.generate import llama_spec

    spec = llama_spec(layers=2)
    assert loader._BlockWriter().write(spec) == _reference(spec)


# ------------------------------------------------------------------ a tensor_map naming an inner mesh axis first
@pytest.mark.parametrize("mesh_shape, entry", [
    ([2, 1, 2], [0, 2]),  # issue 37's example: (_S(0,2), R, S(0))
    ([2, 3, 2], [0, 2]),
    ([2, 3, 2], [0, 1, 2]),
    ([2, 3, 2], [1, 2, 0]),
    ([2, 3, 2], [2, 0, 1]),
    ([2, 3, 2], [2, 1, 0]),  # mesh order: plain shards, as before
])
def test_an_inner_first_tensor_map_is_written_back_as_itself(mesh_shape, entry):
    """load -> write (the value's tensor_map, as check reports it) -> load gives the same layout, and
    the tensor_map written is the one read."""
    from layout_prop.api import analyze, format_table

    def spec(tensor_map) -> dict:
        return {"mesh": {"shape": mesh_shape, "names": ["dp", "pp", "tp"]},
                "inputs": {"x": {"shape": [24, 4], "tensor_map": tensor_map}, "w": {"shape": [4, 3]}},
                "nodes": [{"name": "y", "op": "matmul", "inputs": ["x", "w"]}]}

    first = load_spec(spec([entry, -1]))
    analysis = analyze(first)
    written = analysis.report()["tensors"]["x"]["tensor_map"]
    assert written == [entry, -1]
    again = load_spec(parse_spec(format_spec(spec(written))))
    assert again.node("x").attrs["placements"] == first.node("x").attrs["placements"]
    row = next(line for line in format_table(analysis).splitlines() if line.startswith("x "))
    assert f"[{entry}, -1]".replace(" ", "") in row.replace(" ", "") and "none (strided)" not in row


def test_a_strided_shard_no_tensor_map_makes_is_still_none():
    """(_S(0,4), R) on a 2 x 2 mesh: no order of the two axes cuts dim 0 so (k would be 2 at most)."""
    from layout_prop.api import analyze, format_table

    g = load_spec({"mesh": {"shape": [2, 2], "names": ["dp", "tp"]},
                   "inputs": {"x": {"shape": [8, 4], "placements": ["_S(0,4)", "R"]}, "w": {"shape": [4, 3]}},
                   "nodes": [{"name": "y", "op": "matmul", "inputs": ["x", "w"]}]})
    analysis = analyze(g)
    assert analysis.report()["tensors"]["x"]["tensor_map"] is None
    row = next(line for line in format_table(analysis).splitlines() if line.startswith("x "))
    assert "none (strided)" in row
