"""Load a spec (YAML or JSON, see DESIGN.md) into a :class:`~layout_prop.core.graph.Graph`.

Every mistake is a :class:`~layout_prop.core.errors.SpecError` (or the LayoutError /
OpError of the value at fault) carrying a code, the path in the spec
(``nodes[2].inputs[1]``) and a hint.

Examples
--------
>>> g = load_spec('''
... mesh: {shape: [2, 2], names: [dp, tp]}
... inputs:
...   x: {shape: [4, 8], placements: ["S(0)", R]}
... nodes:
...   - {name: y, op: add, inputs: [x, x]}
... outputs: [y]
... ''')
>>> g.mesh, g.outputs
(DeviceMesh(shape=(2, 2), names=('dp', 'tp')), ['y'])
>>> load_spec("mesh: {shape: [2]}\\ninputs: {x: {shape: [4], placements: [Q]}}\\nnodes: []")
Traceback (most recent call last):
...
layout_prop.core.errors.SpecError: bad-placement at inputs.x.placements[0]: cannot parse placement 'Q' (hint: write R, S(d) (d an integer, may be negative), P or P(sum|avg|max|min))
"""

from __future__ import annotations

import io
import json
import math
import operator
import re
from itertools import chain, compress, repeat
from pathlib import Path
from typing import Any

import yaml

from .block_yaml import PLAIN, read_block_yaml
from .reader import read_file_bytes, read_text
from layout_prop.core import meta
from layout_prop.core.errors import CONTROL_CHARS, GraphError, LayoutPropError, SpecError, cut, printable
from layout_prop.core.graph import Graph, Node, output_counts, split_value
from layout_prop.core.layout import Layout
from layout_prop.core.mesh import MAX_MESH_AXES, MAX_RANKS, MAX_TENSOR_RANK, DeviceMesh
from layout_prop.core.placement import parse_placement
from layout_prop.core.registry import OpRule, get_rule
from layout_prop.core.spec import FLOAT_DTYPES, TensorSpec, check_dtype

__all__ = ["load_spec", "parse_spec", "dump_yaml", "format_spec", "read_spec_text", "read_file_bytes", "MAX_SPEC_BYTES", "MAX_DEPTH",
           "MAX_ELEMENTS"]

#: the largest spec file read (a 100,000-node generated spec is about 15 MiB of JSON)
MAX_SPEC_BYTES = 64 * 2 ** 20
#: the deepest nesting of lists and mappings a spec may have (a spec needs about 6)
MAX_DEPTH = 64
#: YAML aliases may expand a spec to at most this many times its written items, plus
#: ALIAS_SLACK (a "billion laughs" spec of 530 bytes expands to 9^9 items)
ALIAS_FACTOR, ALIAS_SLACK = 10, 100_000
#: the most elements a tensor may have, and the largest size of one of its dims: numpy's
#: index type (int64) must hold every element's byte offset
MAX_ELEMENTS = 2 ** 62
#: the longest name (of a value, a node, a mesh axis) and the longest attr list or string
MAX_NAME, MAX_ATTR_ITEMS = 256, 4096

TOP_KEYS = {"mesh", "inputs", "nodes", "outputs", "name", "description", "constraints", "pipeline", "zero",
            "recompute", "training"}
MESH_KEYS = {"shape", "names", "links"}
INPUT_KEYS = {"shape", "dtype", "placements", "tensor_map", "requires_grad"}
NODE_KEYS = {"name", "op", "inputs", "attrs"}
NODE_REQUIRED = {"name", "op"}


def _err(code: str, message: str, path: str, hint: str) -> SpecError:
    return SpecError(code, message, path=path, hint=hint)


def _rethrow(err: LayoutPropError, path: str) -> SpecError:
    return SpecError(err.code, err.message, path=path, hint=err.hint)


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when PyYAML has it
    """A safe YAML loader that refuses a key written twice in one mapping (YAML keeps the last
    silently) and reads ``1e-6`` as a number, as JSON and YAML 1.2 do (PyYAML, a YAML 1.1
    parser, reads a float without a dot as a string)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if duplicate:
                raise _DuplicateKey(None, None, f"key {cut(key)} is written twice in one mapping", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class _SpecDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # libyaml's emitter when PyYAML has it
    """The YAML writer of :func:`dump_yaml`: no anchors, and the loader's resolvers.

    libyaml's emitter writes the text (ten times faster than PyYAML's own on a 10,000-node
    spec); which strings are quoted is still decided here, in Python, by the resolvers: a
    string the loader would read as something else ("1e3", "yes", "null", "0x10") is quoted.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resolved: dict[tuple, str] = {}  # (scalar text, implicit) -> the tag the resolvers give it

    def ignore_aliases(self, data):  # shared lists stay written out, no &anchors
        return True

    def resolve(self, kind, value, implicit):
        """The resolvers' tag, once per distinct scalar text (names, ops and keys repeat in a spec:
        the serializer asks twice per scalar, 17 times a node of a Relu chain)."""
        if kind is not yaml.ScalarNode:
            return super().resolve(kind, value, implicit)
        key = (value, implicit)
        tag = self._resolved.get(key)
        if tag is None:
            tag = self._resolved[key] = super().resolve(kind, value, implicit)
        return tag

    def represent_data(self, data):
        """The node of ``data``, built directly for the types a spec holds (str, int, bool, None,
        list and dict), as SafeRepresenter builds it with ``default_flow_style=None`` and no aliases
        (a collection of plain scalars only is written in flow style); anything else, floats
        included (their text has rules of its own), through SafeRepresenter."""
        kind = type(data)
        if kind is str:
            return yaml.ScalarNode(_STR_TAG, data, style=self.default_style)
        if kind is int:
            return yaml.ScalarNode(_INT_TAG, str(data), style=self.default_style)
        if kind is bool:
            return yaml.ScalarNode(_BOOL_TAG, "true" if data else "false", style=self.default_style)
        if data is None:
            return yaml.ScalarNode(_NULL_TAG, "null", style=self.default_style)
        if kind is list:
            items = [self.represent_data(item) for item in data]
            flow = all(type(item) is yaml.ScalarNode and not item.style for item in items)
            return yaml.SequenceNode(_SEQ_TAG, items, flow_style=self._flow(flow))
        if kind is dict and not self.sort_keys:
            pairs = [(self.represent_data(key), self.represent_data(value)) for key, value in data.items()]
            flow = all(type(k) is yaml.ScalarNode and not k.style and type(v) is yaml.ScalarNode and not v.style
                       for k, v in pairs)
            return yaml.MappingNode(_MAP_TAG, pairs, flow_style=self._flow(flow))
        return super().represent_data(data)

    def _flow(self, best: bool) -> bool:
        return self.default_flow_style if self.default_flow_style is not None else best


_STR_TAG, _INT_TAG, _FLOAT_TAG, _BOOL_TAG, _NULL_TAG, _SEQ_TAG, _MAP_TAG = (
    f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "seq", "map"))


# floats with an exponent and no dot (1e-6, 2E+3), which YAML 1.1's float pattern misses; the
# dumper knows them too, so that it quotes a string such as "1e3" (a name) instead of writing
# it plain, which the loader would read back as the number 1000.0
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _resolving in (_UniqueKeyLoader, _SpecDumper):
    _resolving.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def dump_yaml(spec: dict) -> str:
    """``spec`` as the block YAML that ``gen``, ``import`` and ``plan`` write, read back equal.

    >>> print(dump_yaml({"inputs": {"1e3": {"shape": [4]}}, "attrs": {"eps": 1e-06}}), end="")
    inputs:
      '1e3':
        shape: [4]
    attrs: {eps: 1.0e-06}
    >>> parse_spec(dump_yaml({"1e3": "2E5"}))
    {'1e3': '2E5'}
    """
    text = _BlockWriter().write(spec)  # the common shape, in Python's string joins (4 times faster)
    return text if text is not None else _emit_yaml(spec)


def _emit_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_SpecDumper, sort_keys=False, default_flow_style=None, width=_YAML_WIDTH)


_YAML_WIDTH = 120
#: the plain scalars the block writer writes itself: those the line reader reads (block_yaml.PLAIN),
#: shorter than libyaml's simple keys, neither a lone "-" nor a document marker
_WRITER_PLAIN = re.compile(rf"(?!---|-$){PLAIN}")


class _BlockWriter:
    """The text :func:`_emit_yaml` writes, for specs of the common shape: block mappings and
    sequences whose leaves are plain scalars or flow collections of them, each line at most
    the emitter's width, every string one the emitter writes plain (it resolves to a string
    and reads as the line reader reads it).  :meth:`write` gives None for anything else, and a
    top-level list's entry (a node) that is not of that shape is written by the emitter alone,
    at the same column (graph_tests/test_yaml_roundtrip.py compares the two texts).

    libyaml's emitter spends most of its time calling back into Python (two resolver calls
    per scalar) and PyYAML builds a node object per value; here a scalar's text is found once.
    """

    def __init__(self) -> None:
        self._dumper = _SpecDumper(io.StringIO())  # its resolvers decide what reads back as a string
        self._texts: dict[Any, str | None] = {}  # (type, value) -> its plain text, or None: not written here
        self._floats = yaml.representer.SafeRepresenter()

    def write(self, spec: Any) -> str | None:
        if type(spec) is not dict or self._flow(spec) is not None:  # (a mapping of scalars only is one flow line)
            return None
        lines: list[str] = []
        if not self._mapping(spec, 0, lines):
            return None
        lines.append("")
        return "\n".join(lines)

    def _scalar(self, value: Any) -> str | None:
        kind = type(value)
        if kind is float:  # (not kept: 0.0 and -0.0 are one key of a dict)
            text = self._floats.represent_float(value).value
            return text if self._dumper.resolve(yaml.ScalarNode, text, (True, False)) == _FLOAT_TAG else None
        key = (kind, value)
        try:
            return self._texts[key]
        except KeyError:
            pass
        except TypeError:  # a list or a mapping: not a scalar
            return None
        text, tag = None, None
        if kind is str:
            text, tag = value, _STR_TAG
            if len(value) >= 128 or not _WRITER_PLAIN.fullmatch(value):
                text = None
        elif kind is bool:
            text, tag = ("true" if value else "false"), _BOOL_TAG
        elif kind is int:
            text, tag = str(value), _INT_TAG
        elif value is None:
            text, tag = "null", _NULL_TAG
        if text is not None and self._dumper.resolve(yaml.ScalarNode, text, (True, False)) != tag:
            text = None  # ("yes", "1e3", "null" as strings: the emitter quotes them)
        self._texts[key] = text
        return text

    def _flow(self, value: Any) -> str | None:
        """``value`` on one line: a scalar, or a list or mapping of scalars in flow style."""
        kind = type(value)
        if kind is list:
            texts = [self._scalar(item) for item in value]
            return None if None in texts else f"[{', '.join(texts)}]"
        if kind is dict:
            texts = [(self._scalar(k) if type(k) is str else None, self._scalar(v)) for k, v in value.items()]
            if any(k is None or v is None for k, v in texts):
                return None
            return "{" + ", ".join(f"{k}: {v}" for k, v in texts) + "}"
        return self._scalar(value)

    def _mapping(self, data: dict, indent: int, lines: list[str]) -> bool:
        for key, value in data.items():
            entry: list[str] = []
            if self._entry(key, value, indent, entry):
                lines.extend(entry)
            elif indent == 0 and type(value) in (dict, list):  # the emitter writes it at the same column (a
                lines.extend(_emit_yaml({key: value}).splitlines())  # scalar would make {key: value} flow)
            else:
                return False
        return True

    def _entry(self, key: Any, value: Any, indent: int, lines: list[str]) -> bool:
        pad = " " * indent
        name = self._scalar(key) if type(key) is str else None
        if name is None:
            return False
        flow = self._flow(value)
        if flow is not None:
            line = f"{pad}{name}: {flow}"
            lines.append(line)
            return len(line) <= _YAML_WIDTH
        if not self._collection(value):
            return False
        lines.append(f"{pad}{name}:")
        if type(value) is dict:
            return self._mapping(value, indent + 2, lines)
        return self._sequence(value, indent, lines)  # (a list in a mapping is not indented)

    @staticmethod
    def _collection(value: Any) -> bool:
        return type(value) in (dict, list) and bool(value)  # (an empty one has a flow text)

    def _sequence(self, items: list, indent: int, lines: list[str]) -> bool:
        pad = " " * indent
        for item in items:
            flow = self._flow(item)
            if flow is not None and len(pad) + 2 + len(flow) <= _YAML_WIDTH:
                lines.append(f"{pad}- {flow}")
                continue
            entry: list[str] = []
            if flow is None and type(item) is dict and item and self._mapping(item, indent + 2, entry):
                entry[0] = f"{pad}- {entry[0][indent + 2:]}"
                lines.extend(entry)
            elif indent == 0 and type(item) in (dict, list):  # the emitter writes it at the same column
                lines.extend(_emit_yaml([item]).splitlines())
            else:
                return False
        return True


def format_spec(spec: dict, path: Path | None = None) -> str:
    """The text ``gen``, ``import`` and ``plan`` write for ``spec`` to ``path``: JSON when its
    suffix is ``.json`` in any case, else block YAML (:func:`dump_yaml`; also with no path).

    >>> format_spec({"nodes": []}, Path("x.JSON")) == json.dumps({"nodes": []}, indent=1)
    True
    >>> format_spec({"nodes": []})
    'nodes: []\\n'
    """
    if path is not None and path.suffix.lower() == ".json":
        return json.dumps(spec, indent=1)
    return dump_yaml(spec)


#: the first characters of the plain scalars the loader may read as something else than a
#: string; None when a resolver is tried whatever the first character (PyYAML's are not)
_IMPLICIT_FIRST = None if None in _UniqueKeyLoader.yaml_implicit_resolvers else \
    frozenset(_UniqueKeyLoader.yaml_implicit_resolvers)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # read by YAML instead, as the string it is there


def _json_mapping(pairs: list) -> dict:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        raise ValueError("a key written twice")  # YAML reports it with its position
    return mapping


def parse_spec(text: str, source: str = "<spec>", what: str = "spec") -> dict:
    """Parse YAML or JSON text into a dict (``spec-syntax`` on malformed text or a key written twice).

    ``what`` names the file in the refusal of a text that is not a mapping (the same parser reads
    plans and cluster profiles, :func:`layout_prop.io.reader.read_mapping`).

    Text that is a JSON object is read by the json module (fast on large generated specs);
    anything else, and JSON with a problem, by the YAML loader, which reports where.

    >>> parse_spec("attrs: {eps: 1e-6, mode: 1}")["attrs"]
    {'eps': 1e-06, 'mode': 1}
    """
    data = None
    if text.lstrip().startswith("{"):
        try:
            data = _parse_json(text, source)
        except (ValueError, RecursionError):  # YAML reports where (nesting too deep, digits too many)
            pass
    checked = data is not None  # (JSON's depth is checked as it is read)
    if data is None:
        data = _parse_yaml_fast(text)  # a tree (no aliases): only its depth to check
        if data is not _MISSING:
            if isinstance(data, dict):
                _check_depth(data, source)
            checked = True
        else:
            data = _parse_yaml(text, source)
    if not isinstance(data, dict):
        kind = "nothing" if data is None else f"a {_YAML_KINDS.get(type(data), type(data).__name__)}"
        raise SpecError("spec-syntax", f"{source} holds {kind}, not a mapping", path=source,
                        hint="a spec is a mapping with mesh, inputs, nodes and outputs" if what == "spec" else
                        f"a {what} file is a mapping of keys to values")
    if not checked:
        _check_structure(data, source)  # the depth, and aliases that expand past a size
    return data


def _parse_json(text: str, source: str) -> Any:
    """JSON text as Python values: ValueError on malformed JSON, a ``NaN``/``Infinity`` or a key
    written twice in one object; ``spec-too-deep`` past :data:`MAX_DEPTH`.

    Keys written twice are found without a Python call per object in the common case:
    every ``:`` of JSON text outside a string separates a key from its value, so when the
    text has no more ``:`` than the parsed objects have keys, none was written twice (a
    ``:`` inside a string only makes the count larger, an escaped one is not a ``:`` of the
    text; when the counts differ, the text is parsed again with a hook that compares each
    object's size with its pairs).

    >>> _parse_json('{"a": {"b": 1, "c": "x:y"}}', "s")
    {'a': {'b': 1, 'c': 'x:y'}}
    >>> _parse_json('{"a": 1, "a": 2}', "s")
    Traceback (most recent call last):
    ...
    ValueError: a key written twice
    """
    data = json.loads(text, parse_constant=_not_json)
    keys = _check_depth(data, source)  # JSON has no aliases: only the depth to check
    if text.count(":") != keys:
        data = json.loads(text, object_pairs_hook=_json_mapping, parse_constant=_not_json)
    return data


_MISSING = object()
#: what a spec that is not a mapping holds, in YAML's words
_YAML_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}


def _parse_yaml_fast(text: str) -> Any:
    """The YAML text as Python values, read line by line (:mod:`layout_prop.io.block_yaml`:
    the plain block YAML of generated specs) or built from libyaml's events without PyYAML's
    composer and constructor; ``_MISSING`` for anything but the common case.

    The common case is one document of mappings, sequences and scalars without tags,
    anchors, aliases, merge keys, keys that are not scalars or keys written twice.  Each
    distinct plain scalar is resolved and constructed once, by the same loader
    :func:`_parse_yaml` uses (so ``1e-6``, ``0x10``, ``yes`` or ``~`` read the same);
    quoted and block scalars are strings, as the resolver makes them.  Anything else, and
    any error, gives ``_MISSING``: then :func:`_parse_yaml` reads the text and reports
    what it finds where.

    >>> _parse_yaml_fast("a: [1, '2', x]\\nb: {c: 1e-6, d: ~}")
    {'a': [1, '2', 'x'], 'b': {'c': 1e-06, 'd': None}}
    >>> _parse_yaml_fast("a: &x [1]\\nb: *x") is _MISSING
    True
    """
    loader = _UniqueKeyLoader(text)
    try:
        data = read_block_yaml(text, lambda plain: _plain_scalar(loader, plain))  # one match a line
        return _build_from_events(loader) if data is None else data
    except Exception:  # (a malformed text, an int of 5,000 digits...): the full loader reports it
        return _MISSING
    finally:
        loader.dispose()


def _plain_scalar(loader: _UniqueKeyLoader, text: str) -> Any:
    """A plain scalar's value, resolved (int, float, bool, null, date...) and constructed as
    ``loader`` does (a merge key '<<' has no constructor: it raises, and the loader reads it).

    A text whose first character starts none of the loader's implicit types is the string
    itself, as the resolver and ``construct_yaml_str`` make it, without making a node.

    >>> loader = _UniqueKeyLoader("")
    >>> [_plain_scalar(loader, t) for t in ("rope0", "no", "1e-6", "0x10", "~", "S(0)")]
    ['rope0', False, 1e-06, 16, None, 'S(0)']
    """
    if text and _IMPLICIT_FIRST is not None and text[0] not in _IMPLICIT_FIRST:
        return text
    return loader.construct_object(yaml.ScalarNode(loader.resolve(yaml.ScalarNode, text, (True, False)), text),
                                   deep=True)


def _build_from_events(loader) -> Any:
    events = yaml.events
    get = loader.get_event
    if type(get()) is not events.StreamStartEvent or type(get()) is not events.DocumentStartEvent:
        return _MISSING
    scalar, mapping, sequence = events.ScalarEvent, events.MappingStartEvent, events.SequenceStartEvent
    mapping_end, sequence_end, document_end = events.MappingEndEvent, events.SequenceEndEvent, events.DocumentEndEvent
    plain: dict[str, Any] = {}  # a plain scalar's text -> its value
    stack: list[tuple] = []
    document: list = []  # holds the document's value
    container: Any = document  # the mapping or sequence being read
    in_list = True  # whether it is a sequence
    key: Any = _MISSING  # the mapping's key waiting for its value
    while True:
        event = get()
        kind = type(event)
        if kind is scalar:
            if event.tag is not None or event.anchor is not None:  # (an anchor written twice is an error there)
                return _MISSING
            item = event.value
            if event.implicit[0]:  # plain: resolved (int, float, bool, null, date...) as the loader does
                known = plain.get(item, _MISSING)
                if known is _MISSING:
                    known = plain[item] = _plain_scalar(loader, item)
                item = known
            elif not event.implicit[1]:
                return _MISSING
        elif kind is mapping or kind is sequence:
            if event.tag is not None or event.anchor is not None:
                return _MISSING
            stack.append((container, in_list, key))
            in_list = kind is sequence
            container, key = ([] if in_list else {}), _MISSING
            continue
        elif kind is mapping_end or kind is sequence_end:
            item = container
            container, in_list, key = stack.pop()
        elif kind is document_end:  # then only the stream's end
            return document[0] if type(get()) is events.StreamEndEvent else _MISSING
        else:  # an alias
            return _MISSING
        if in_list:
            container.append(item)
        elif key is _MISSING:
            if kind is not scalar or item in container:  # a key that is a mapping or a sequence, or one written twice
                return _MISSING
            key = item
        else:
            container[key] = item
            key = _MISSING


def _parse_yaml(text: str, source: str) -> Any:
    """YAML text read by PyYAML's loader (libyaml's parser when PyYAML has it): every
    construct, and every error reported with its position."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:  # PyYAML's pure-Python parser (without libyaml) recurses per level
        raise SpecError("spec-too-deep", f"{source} nests lists or mappings too deeply to parse", path=source,
                        hint=f"a spec needs a few levels; at most {MAX_DEPTH} are read") from None
    except ValueError as exc:  # the constructor's int(): more than 4,300 digits
        raise SpecError("spec-syntax", f"{source} has a number that cannot be read: {cut(str(exc), 120)}",
                        path=source, hint="write sizes and dims as ordinary integers") from None
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(getattr(exc, "problem", "")):  # libyaml's limit (1,000 levels)
            raise _too_deep(source) from None
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        lines = text.splitlines()
        line = lines[mark.line] if mark and mark.line < len(lines) else ""
        if mark and mark.column < len(line):  # libyaml's messages do not name what it found there
            where += f" (at {line[mark.column]!r})"
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["?"])[0]
        hint = "write each key once" if isinstance(exc, _DuplicateKey) else \
            "check the indentation, brackets and quotes there"
        raise SpecError("spec-syntax", f"{source} is not valid YAML/JSON at {where}: {cut(problem, 160)[1:-1]}",
                        path=source, hint=hint) from None


def _too_deep(source: str) -> SpecError:
    return SpecError("spec-too-deep", f"{source} nests lists or mappings more than {MAX_DEPTH} deep (or holds a "
                     "value that contains itself, a YAML alias of its own anchor)", path=source,
                     hint="a spec needs a few levels; check the brackets and the aliases")


def _check_depth(data: Any, source: str) -> int:
    """Refuse nesting deeper than :data:`MAX_DEPTH` in a tree (no shared values), a few passes
    in C per level.  Returns how many keys its mappings hold in all.

    >>> _check_depth({"a": [1, {"b": 2}], "c": {}}, "s")
    3
    """
    level: list = [data] if type(data) in _CONTAINERS else []
    keys = 0
    for _ in range(MAX_DEPTH + 1):
        if not level:
            return keys
        # the next level, in C: the values of the mappings and the items of the lists that are containers
        types = list(map(type, level))
        dicts = list(compress(level, map(operator.is_, types, repeat(dict))))
        keys += sum(map(len, dicts))
        below = list(chain(chain.from_iterable(map(dict.values, dicts)),
                           chain.from_iterable(compress(level, map(operator.is_, types, repeat(list))))))
        level = list(compress(below, map(_CONTAINERS.__contains__, map(type, below))))
    raise _too_deep(source)


_CONTAINERS = frozenset((list, dict))


def _check_structure(data: dict, source: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` (a value that contains itself nests
    without end) and YAML aliases that expand the spec far beyond what is written ("billion
    laughs").

    One pass per nesting level over the distinct lists and mappings of that level, each
    with how many times the level holds it (an alias is the same Python object as its
    anchor): the expanded item count is summed from those multiplicities, never by
    expanding anything, so a 530-byte alias bomb costs microseconds.
    """
    objs: list = [data]
    times: list[int] | None = None  # how many times this level holds each container; None: once each
    seen: set[int] = set()
    written = expanded = 0
    for _ in range(MAX_DEPTH):
        sizes = [1 + len(obj) * (2 if type(obj) is dict else 1) for obj in objs]
        expanded += sum(sizes) if times is None else sum(map(operator.mul, sizes, times))
        ids = list(map(id, objs))
        written += sum(size for size, key in zip(sizes, ids) if key not in seen)
        seen.update(ids)
        limit = ALIAS_FACTOR * written + ALIAS_SLACK
        if expanded > limit:
            raise SpecError("spec-too-large", f"{source}'s YAML aliases expand it to over {expanded} items, over the "
                            f"limit {limit} ({ALIAS_FACTOR} times the {written} items written, plus {ALIAS_SLACK})",
                            path=source, hint="write shared values out, or use fewer nested aliases")
        if times is None:  # a tree so far (the common case): plain lists, no bookkeeping per container
            below = [v for obj in objs for v in (obj.values() if type(obj) is dict else obj)
                     if type(v) is list or type(v) is dict]
            if len(set(map(id, below))) == len(below):
                objs = below
                if not objs:
                    return
                continue
            pairs = [(v, 1) for v in below]
        else:
            pairs = [(v, n) for obj, n in zip(objs, times) for v in (obj.values() if type(obj) is dict else obj)
                     if type(v) is list or type(v) is dict]
        merged: dict[int, list] = {}  # shared (aliased) values: one entry each, their times added
        for v, n in pairs:
            entry = merged.get(id(v))
            if entry is None:
                merged[id(v)] = [v, n]
            else:
                entry[1] += n
        objs = [v for v, _ in merged.values()]
        times = [n for _, n in merged.values()]
        if not objs:
            return
    raise _too_deep(source)


def load_spec(source: str | Path | dict) -> Graph:
    """Load a spec from a path, a YAML/JSON string or an already parsed dict."""
    from layout_prop.core.graph import paused_gc

    with paused_gc():  # many small objects that live on, no cycles worth collecting mid-load (as analyze does)
        if isinstance(source, dict):
            return _build(source)
        if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and (
                source.endswith((".yaml", ".yml", ".json")) or _is_path(source))):
            path = Path(source)
            return _build(parse_spec(read_spec_text(path), str(path)))
        return _build(parse_spec(source))


def read_spec_text(path: Path, limit: int = MAX_SPEC_BYTES) -> str:
    """The text of a spec file: at most ``limit`` bytes of UTF-8 (``spec-too-large`` past it).

    Regular files and pipes (``/dev/stdin``, ``<(...)``, a named pipe) are read, see
    :func:`layout_prop.io.reader.read_file_bytes`; a device (``/dev/zero``, a terminal), a
    folder or a socket is refused before reading, so nothing unbounded is ever read.
    """
    return read_text(path, limit, what="spec", missing="spec-not-found", too_large="spec-too-large",
                     syntax="spec-syntax", hint="give the path of a YAML or JSON spec file")


def _is_path(text: str) -> bool:
    """Whether ``text`` names an existing path (a long one-line JSON spec is not a path)."""
    try:
        return bool(text) and Path(text).exists()
    except (OSError, ValueError):
        return False


def _check_keys(obj: Any, allowed: set, required: set, path: str) -> None:
    if type(obj) is dict and allowed.issuperset(obj) and obj.keys() >= required:  # the common case, in C
        return
    if not isinstance(obj, dict):
        raise _err("bad-type", f"expected a mapping, got {type(obj).__name__} {cut(obj)}", path,
                   "write a mapping such as {key: value}")
    unknown = sorted(set(obj) - allowed, key=lambda k: (not isinstance(k, str), str(k)[:100]))
    if unknown:
        first = printable(str(unknown[0])[:100])
        raise _err("unknown-key", f"unknown key(s) {cut(unknown)}", f"{path}.{first}" if path else first,
                   f"allowed keys: {sorted(allowed)}")
    missing = sorted(required - set(obj))
    if missing:
        raise _err("missing-key", f"missing key(s) {missing}", path or "<top>", f"add {missing[0]}")


def _int_list(value: Any, path: str, what: str, minimum: int, maximum: int = MAX_ELEMENTS) -> list[int]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise _err("bad-type", f"{what} must be a list of integers, got {cut(value)}", path,
                   f"write {what} like [2, 2]")
    for i, v in enumerate(value):
        if v < minimum:
            raise _err("bad-value", f"{what}[{i}] is {cut(v)}; it must be at least {minimum}", f"{path}[{i}]",
                       f"use sizes of at least {minimum}")
        if v > maximum:
            raise _err("too-large", f"{what}[{i}] is {cut(v)}, over the limit {maximum}", f"{path}[{i}]",
                       f"use sizes of at most {maximum}")
    return value


def _check_dim_count(value: Any, limit: int, path: str, what: str, unit: str) -> None:
    """``too-many-dims`` for a list longer than ``limit`` (checked before its items are)."""
    if isinstance(value, list) and len(value) > limit:
        raise _err("too-many-dims", f"{what} {cut(value)} has {len(value)} {unit}, over the limit {limit}", path,
                   f"use at most {limit} {unit} (what numpy can index); drop or merge {unit} of size 1")


def _mesh(data: Any) -> DeviceMesh:
    _check_keys(data, MESH_KEYS, {"shape"}, "mesh")
    _check_dim_count(data["shape"], MAX_MESH_AXES, "mesh.shape", "mesh shape", "axes")
    shape = _int_list(data["shape"], "mesh.shape", "mesh shape", 1, MAX_RANKS)
    if not shape:
        raise _err("bad-value", "mesh shape is empty", "mesh.shape", "give at least one mesh axis")
    names = data.get("names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise _err("bad-type", f"mesh names must be a list of strings, got {cut(names)}", "mesh.names",
                   "write names like [dp, tp]")
    for i, name in enumerate(names or ()):
        if _UNPRINTABLE.search(name):
            raise _err("bad-name", f"mesh axis name {cut(name)} has a control or invisible character",
                       f"mesh.names[{i}]", "name axes with printable characters, like dp, tp, sp")
        if len(name) > MAX_NAME:
            raise _err("bad-name", f"mesh axis name {cut(name, 60)} is {len(name)} characters long, over the limit "
                       f"{MAX_NAME}", f"mesh.names[{i}]", "use short axis names like dp, tp, sp")
    try:
        return DeviceMesh(shape, names)
    except LayoutPropError as err:
        # sizes are checked above: a names problem, or too many ranks in all
        raise _rethrow(err, "mesh.shape" if err.code == "too-many-ranks" else "mesh.names") from None


def _input(g: Graph, name: str, data: Any, path: str) -> None:
    _check_keys(data, INPUT_KEYS, {"shape"}, path)
    _check_dim_count(data["shape"], MAX_TENSOR_RANK, f"{path}.shape", "shape", "dims")
    shape = _int_list(data["shape"], f"{path}.shape", "shape", 0)
    elements = 1
    for size in shape:
        elements *= size
    if elements > MAX_ELEMENTS:
        raise _err("too-large", f"shape {cut(shape)} has {elements} elements, over the limit {MAX_ELEMENTS} (2^62)",
                   f"{path}.shape", "a tensor's byte offsets must fit in a 64-bit integer; use smaller sizes")
    dtype = data.get("dtype", "float32")
    try:
        dtype = check_dtype(dtype) if isinstance(dtype, str) else check_dtype(repr(dtype))
    except LayoutPropError as err:
        raise _rethrow(err, f"{path}.dtype") from None
    if "placements" in data and "tensor_map" in data:
        raise _err("conflicting-keys", "both placements and tensor_map are given", path,
                   "give exactly one of placements (per mesh axis) and tensor_map (per tensor dim)")
    floating = dtype in FLOAT_DTYPES
    requires_grad = data.get("requires_grad", floating)  # token ids and masks take no gradient
    if not isinstance(requires_grad, bool):
        raise _err("bad-type", f"requires_grad must be true or false, got {cut(requires_grad)}",
                   f"{path}.requires_grad", "write requires_grad: false")
    if requires_grad and not floating:
        raise _err("bad-value", f"input of dtype {dtype} has requires_grad: true; only floating inputs take a "
                   "gradient", f"{path}.requires_grad", "leave requires_grad out (integer and bool inputs default "
                   "to false) or give the input a float dtype")
    placements: Any
    if "tensor_map" in data:
        tm = data["tensor_map"]
        if not isinstance(tm, list):
            raise _err("bad-type", f"tensor_map must be a list, got {cut(tm)}", f"{path}.tensor_map",
                       "write one entry per tensor dim, like [1, -1, 0, -1]")
        if len(tm) != len(shape):
            raise _err("invalid-layout", f"tensor_map has {len(tm)} entries for a tensor of rank {len(shape)}",
                       f"{path}.tensor_map", "give one entry per tensor dim")
        entries = [tuple(e) if isinstance(e, list) else e for e in tm]
        try:  # the common case: the whole map is fine, and is built once
            layout = Layout.from_tensor_map(g.mesh, entries)
            TensorSpec(shape, dtype, layout)
        except LayoutPropError:
            layout = None
        # otherwise prefixes: the first entry that breaks the layout is the one at fault (the last
        # prefix is the whole map, so this raises)
        for d in range(0 if layout is not None else len(entries)):
            try:
                prefix = Layout.from_tensor_map(g.mesh, entries[:d + 1] + [-1] * (len(entries) - d - 1))
                TensorSpec(shape, dtype, prefix)
            except LayoutPropError as err:
                raise _rethrow(err, f"{path}.tensor_map[{d}]") from None
        placements = layout.placement_strs()
    elif data.get("placements") == "auto":
        placements = "auto"
    else:
        raw = data.get("placements", ["R"] * g.mesh.ndim)
        if not isinstance(raw, list):
            raise _err("bad-type", f"placements must be a list or 'auto', got {cut(raw)}", f"{path}.placements",
                       "write one placement per mesh axis, like [\"S(0)\", R]")
        if len(raw) != g.mesh.ndim:
            raise _err("invalid-layout", f"{len(raw)} placements for a mesh of {g.mesh.ndim} axes "
                       f"{list(g.mesh.names)}", f"{path}.placements", "give one placement per mesh axis")
        for i in range(len(raw)):
            if isinstance(raw[i], str) and len(raw[i]) > 40:  # S(<4,300 digits>) would not even parse
                raise _err("bad-placement", f"placement {cut(raw[i], 60)} is {len(raw[i])} characters long",
                           f"{path}.placements[{i}]", "write R, S(d), P or P(op) with a small integer d")
        try:  # the common case: the whole layout is fine, and is built once
            TensorSpec(shape, dtype, Layout(g.mesh, raw, len(shape)))
            fine = True
        except LayoutPropError:
            fine = False
        # otherwise prefixes: the first placement that breaks the layout is the one at fault (the last
        # prefix is the whole layout, so this raises)
        for i in range(0 if fine else len(raw)):
            try:
                prefix = [parse_placement(p) for p in raw[:i + 1]] + ["R"] * (len(raw) - i - 1)
                TensorSpec(shape, dtype, Layout(g.mesh, prefix, len(shape)))
            except LayoutPropError as err:
                raise _rethrow(err, f"{path}.placements[{i}]") from None
        placements = raw
    g.input(name, shape=shape, dtype=dtype, placements=placements, requires_grad=requires_grad)


#: control and invisible characters (:data:`layout_prop.core.errors.CONTROL_CHARS`): never in a name
_UNPRINTABLE = re.compile(f"[\n{CONTROL_CHARS}]")
RESERVED_CHARS = (":", "@", "#")  # value indexes, and the names lowering gives local slices and steps
RESERVED_PREFIXES = ("grad:", "grad/", "cotangent/")  # the names the backward pass gives its values


#: a name that passes every check of :func:`_check_name` at once (no control or reserved character,
#: so no reserved prefix either), when it is at most MAX_NAME long
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _check_name(name: Any, path: str) -> str:
    if type(name) is str and len(name) <= MAX_NAME and _PLAIN_NAME.fullmatch(name):  # the common name
        return name
    if not isinstance(name, str) or not name:
        raise _err("bad-name", f"name {cut(name)} is not a non-empty string", path, "name values like x, q_rot, l0_h")
    if _UNPRINTABLE.search(name):
        raise _err("bad-name", f"name {cut(name)} has a control or invisible character", path,
                   "name values with printable characters, like x, q_rot, l0_h")
    if len(name) > MAX_NAME:
        raise _err("bad-name", f"name {cut(name, 60)} is {len(name)} characters long, over the limit {MAX_NAME}",
                   path, "use shorter names")
    bad = [c for c in RESERVED_CHARS if c in name]
    if bad or name.startswith(RESERVED_PREFIXES):
        raise _err("bad-name", f"name {cut(name)} uses {bad[0]!r}" if bad else
                   f"name {cut(name)} starts with a prefix the backward pass uses", path,
                   "use names without ':', '@' or '#' and not starting with grad/ or cotangent/")
    return name


_NO_INPUTS: list = []
_NO_ATTRS: dict = {}  # (never changed: each node's attrs are a copy)


def _nodes(data: Any, defined: set[str]) -> tuple[list[tuple[int, Node]], bool]:
    """Every node of the spec, checked on its own, as ``(index, Node)``, and whether they come in
    order (every input an input of the graph or an output of a node written before: the common
    case, in which :func:`_order` has nothing to sort and nothing to report)."""
    if not isinstance(data, list):
        raise _err("bad-type", f"nodes must be a list, got {type(data).__name__}", "nodes",
                   "write nodes as a list of {name, op, inputs, attrs}")
    seen: dict[str, int] = {}
    out = []
    values = set(defined)  # the values defined so far, while the nodes come in order
    in_order = True
    rules: dict[str, tuple] = {}  # op -> (rule, its arity, whether it checks attrs as OpRule does), once per op
    checked: set[tuple] = set()  # (op, attr names) that passed OpRule's check, with no null value
    keys_and_names = _keys_and_names_fine(data, defined)
    for i, nd in enumerate(data):
        # each check takes its common case first, in C; the path of a mistake is written only for one
        if not keys_and_names:
            _check_keys(nd, NODE_KEYS, NODE_REQUIRED, f"nodes[{i}]")
            name = _check_name(nd["name"], f"nodes[{i}].name")
            if name in defined or name in seen:
                raise _err("duplicate-name", f"name {cut(name)} is defined twice", f"nodes[{i}].name",
                           "give every input and node a distinct name")
            seen[name] = i
        name = nd["name"]
        op = nd["op"]
        known = rules.get(op) if type(op) is str else None
        if known is None:
            if not isinstance(op, str):
                raise _err("bad-type", f"op must be a string, got {cut(op)}", f"nodes[{i}].op", "write op: add")
            try:
                rule = get_rule(op, node=name)
            except LayoutPropError as err:
                raise SpecError(err.code, err.message, path=f"nodes[{i}].op", node=name, hint=err.hint) from None
            known = rules[op] = (rule, rule.arity(), type(rule).normalize_attrs is OpRule.normalize_attrs)
        rule, (low, high), plain = known
        inputs = nd.get("inputs", _NO_INPUTS)
        if type(inputs) is not list or not _all_str(inputs):
            raise _err("bad-type", f"inputs must be a list of value names, got {cut(inputs)}", f"nodes[{i}].inputs",
                       "write inputs: [x, cos, sin]")
        attrs = nd.get("attrs") or _NO_ATTRS
        if type(attrs) is not dict:
            raise _err("bad-type", f"attrs must be a mapping, got {cut(attrs)}", f"nodes[{i}].attrs",
                       "write attrs: {mode: 0}")
        if attrs and not (_SCALARS.issuperset(map(type, attrs.values())) and _all_str(attrs)):
            _check_attr_values(attrs, f"nodes[{i}].attrs")  # (integers, booleans and nulls under string keys pass)
        # OpRule's check depends on the attr names and the values' types only when no value is null or a
        # list (whose items it may check): each set of names and types is checked once
        key = (op, tuple(attrs), tuple(map(type, attrs.values()))) if plain and _SCALARS_BUT_NULL.issuperset(
            map(type, attrs.values())) else None
        if key is None or key not in checked:
            try:
                rule.normalize_attrs(attrs, name)
            except LayoutPropError as err:
                where = f"nodes[{i}].{err.path}" if err.path and err.path.startswith("attrs.") else f"nodes[{i}].attrs"
                raise SpecError(err.code, err.message, path=where, node=name, hint=err.hint) from None
            if key is not None:
                checked.add(key)
        if len(inputs) < low or (high is not None and len(inputs) > high):
            raise SpecError("bad-arity", f"op {rule.name!r} takes {rule.arity_text()}, got {len(inputs)}",
                            path=f"nodes[{i}].inputs", node=name, hint=f"give {rule.name} {rule.arity_text()}")
        node = Node(name, rule.name, tuple(inputs), dict(attrs), rule.num_outputs)
        if in_order:
            if values.issuperset(inputs):
                values.update(node.outputs)
            else:
                in_order = False
        out.append((i, node))
    return out, in_order


#: names that each pass :func:`_check_name` at once, one per line
_PLAIN_NAMES = re.compile(r"[A-Za-z0-9_.\-]+(?:\n[A-Za-z0-9_.\-]+)*")


def _keys_and_names_fine(data: list, defined: set[str]) -> bool:
    """Whether every node is a mapping with known keys, a name and an op, and the names are
    plain (:func:`_check_name`), at most MAX_NAME long, distinct and not the graph's inputs:
    the checks :func:`_nodes` makes node by node, made at once over the whole list in C."""
    if set(map(type, data)) != {dict} or not all(map(NODE_KEYS.issuperset, data)) \
            or not all(map(NODE_REQUIRED.issubset, map(dict.keys, data))):
        return False
    names = [nd["name"] for nd in data]
    if not _all_str(names) or max(map(len, names)) > MAX_NAME:
        return False
    lines = "\n".join(names)  # (a name with a newline in it would look like two)
    return (lines.count("\n") == len(names) - 1 and _PLAIN_NAMES.fullmatch(lines) is not None
            and len(set(names)) == len(names) and defined.isdisjoint(names))


def _all_str(items: list) -> bool:
    """Whether every item is a string (``str.join`` checks it in C)."""
    try:
        "".join(items)
    except TypeError:
        return False
    return True


#: attribute values that need no check (a float does: NaN and the infinities are refused)
_SCALARS = frozenset((int, bool, type(None)))
#: the types of attr values whose check by OpRule depends on the type only
_SCALARS_BUT_NULL = frozenset((int, bool, float, str))


def _check_attr_values(attrs: dict, path: str) -> None:
    """Attribute names are strings; values are what JSON can write: finite numbers, strings,
    booleans, null, lists of them and mappings with string keys (never a YAML ``!!set``, a
    timestamp, binary data, ``.nan`` or ``.inf``, which rules cannot compare, hash or compute
    with)."""
    stack = [(attrs, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise _err("bad-attr", f"attribute key {cut(key)} is of type {type(key).__name__}, not a string",
                               where, "write attribute names as strings")
                if type(item) not in _SCALARS:  # (an integer, a boolean or null is fine as it is)
                    stack.append((item, f"{where}.{printable(key[:100])}"))
        elif isinstance(value, list):
            if len(value) > MAX_ATTR_ITEMS:
                raise _err("bad-attr", f"attribute value {cut(value)} has {len(value)} items, over the limit "
                           f"{MAX_ATTR_ITEMS}", where, "attributes are a few numbers or names")
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value) if type(item) not in _SCALARS)
        elif isinstance(value, str) and len(value) > MAX_ATTR_ITEMS:
            raise _err("bad-attr", f"attribute value {cut(value)} is {len(value)} characters long, over the limit "
                       f"{MAX_ATTR_ITEMS}", where, "attributes are a few numbers or names")
        elif isinstance(value, float) and not math.isfinite(value):
            raise _err("bad-attr", f"attribute value {value} is not a finite number", where,
                       "write a finite number: JSON has no NaN or infinity, and rules cannot compute with them")
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise _err("bad-attr", f"attribute value {cut(value)} is of type {type(value).__name__}", where,
                       "write numbers, strings, booleans, lists and mappings (no !!set, dates or binary)")


def _order(nodes: list[tuple[int, Node]], g: Graph) -> list[tuple[int, Node]]:
    """Order nodes so every value is defined before use; report undefined values and cycles."""
    producers = {value: i for i, node in nodes for value in node.outputs}
    inputs = {node.name for node in g.inputs()}  # the values g holds so far (inputs: one value each)
    in_order = True  # as written: every value defined before its use (no deps to sort)
    for i, node in nodes:
        for j, value in enumerate(node.inputs):
            if value in inputs:
                continue
            producer = producers.get(value)
            if producer is not None:
                if producer >= i:
                    in_order = False
                continue
            base, _ = split_value(value)
            hint = "define the value as an input or a node before using it"
            if base in producers or base in g:
                hint = f"{cut(base)} has several outputs: name one as {base}:0, {base}:1, ..."
            raise SpecError("undefined-value",
                            f"input {j} of node {cut(node.name)} is {cut(value)}, which is not defined",
                            path=f"nodes[{i}].inputs[{j}]", node=node.name, input=value, hint=hint)
    if in_order:
        return list(nodes)
    deps = {i: {producers[value] for value in node.inputs if value not in inputs} for i, node in nodes}
    # Depth-first, deps in index order, iteratively: a long chain given in reverse order
    # must not hit Python's recursion limit, and no closure may keep the spec alive in a cycle.
    nodes_by = {i: node for i, node in nodes}
    state: dict[int, int] = {}  # 1: on the current path, 2: placed
    done: list[int] = []
    for root, _ in nodes:
        if state.get(root) == 2:
            continue
        state[root] = 1
        path = [(root, iter(sorted(deps[root])))]
        while path:
            i, pending = path[-1]
            for d in pending:
                if state.get(d) == 2:
                    continue
                if state.get(d) == 1:
                    on_path = [k for k, _ in path]
                    names = [nodes_by[k].name for k in on_path[on_path.index(d):]] + [nodes_by[d].name]
                    raise SpecError("cycle", f"nodes form a cycle: {' -> '.join(names)}", path=f"nodes[{d}]",
                                    node=nodes_by[d].name, hint="a value cannot depend on itself; break the loop")
                state[d] = 1
                path.append((d, iter(sorted(deps[d]))))
                break
            else:
                path.pop()
                state[i] = 2
                done.append(i)
    by_index = dict(nodes)
    return [(i, by_index[i]) for i in done]


def _output_counts(nodes: list[tuple[int, Node]], g: Graph) -> list[tuple[int, Node]] | None:
    """The nodes with the output count of each op whose count follows its attrs and input shapes
    worked out (:func:`layout_prop.core.graph.output_counts`), or None when no count changes."""
    try:
        counted = output_counts([node for _, node in nodes], {node.name: node for node in g.inputs()}, g.mesh)
    except LayoutPropError as err:
        index = next((i for i, node in nodes if node.name == err.node), None)
        raise SpecError(err.code, err.message, path=f"nodes[{index}]" if index is not None else "nodes",
                        node=err.node, hint=err.hint) from None
    if all(map(operator.is_, counted, (node for _, node in nodes))):
        return None
    return [(i, node) for (i, _), node in zip(nodes, counted)]


def _build(data: dict) -> Graph:
    _check_keys(data, TOP_KEYS, {"mesh", "inputs", "nodes"}, "")
    g = Graph(_mesh(data["mesh"]))
    if "links" in data["mesh"]:  # per-axis bandwidth and latency, for the planner's time objective
        from layout_prop.core.links import parse_links

        g.meta[meta.LINKS] = parse_links(data["mesh"]["links"], g.mesh)
    inputs = data["inputs"]
    if not isinstance(inputs, dict) or not inputs:
        raise _err("bad-type", f"inputs must be a non-empty mapping of name -> spec, got {cut(inputs)}", "inputs",
                   "write inputs: {x: {shape: [4, 8]}}")
    for name, spec in inputs.items():
        _check_name(name, f"inputs.{name}")
        _input(g, name, spec, f"inputs.{name}")
    nodes, in_order = _nodes(data["nodes"], set(inputs))
    counted = _output_counts(nodes, g)  # unbind, chunk, split: as many outputs as their attrs and shapes make
    if counted is not None:
        nodes, in_order = counted, False
    if in_order:  # names distinct and every input defined before its use: checked above, node by node
        g.extend_checked(node for _, node in nodes)
    else:
        for i, node in _order(nodes, g):
            try:
                g.add_node(node)
            except GraphError as err:
                raise SpecError(err.code, err.message, path=f"nodes[{i}]", node=node.name, hint=err.hint) from None
    outputs = data.get("outputs")
    if outputs is None:
        used = {v for n in g.nodes for v in n.inputs}
        outputs = [v for n in g.nodes if not n.is_input for v in n.outputs if v not in used]
    if not isinstance(outputs, list) or not all(isinstance(v, str) for v in outputs):
        raise _err("bad-type", f"outputs must be a list of value names, got {cut(outputs)}", "outputs",
                   "write outputs: [y]")
    listed: set[str] = set()
    for k, value in enumerate(outputs):
        if value in listed:
            raise _err("duplicate-output", f"output {cut(value)} is listed twice", f"outputs[{k}]",
                       "list every output once")
        listed.add(value)
        if not g.has_value(value):
            raise _err("undefined-value", f"output {cut(value)} is not defined", f"outputs[{k}]",
                       "name a node (or node:i) as an output")
    g.output(*outputs)
    if data.get("constraints") is not None:  # pinned activations: a sharding_constraint node after each
        from .constraints import apply_constraints, parse_constraints

        g = apply_constraints(g, parse_constraints(data["constraints"], g.mesh))
    if data.get("pipeline") is not None:  # pipeline stages: read by passes/pipeline.py (PipelineConfig.from_spec)
        if not isinstance(data["pipeline"], dict):
            raise _err("bad-type", f"pipeline must be a mapping, got {cut(data['pipeline'])}", "pipeline",
                       "write pipeline: {axis: pp, micro_batches: 4, schedule: 1f1b}")
        g.meta[meta.PIPELINE] = dict(data["pipeline"])
    if data.get("training") is not None:  # global batch and micro-batch: checked by io/spec_blocks.py (parse_training)
        if not isinstance(data["training"], dict):
            raise _err("bad-type", f"training must be a mapping, got {cut(data['training'])}", "training",
                       "write training: {global_batch: 512, micro_batch: 1}")
        g.meta[meta.TRAINING] = dict(data["training"])
    # read by passes/zero.py (parse_zero) and passes/recompute.py (parse_recompute)
    for key, meta_key in (("zero", meta.ZERO), ("recompute", meta.RECOMPUTE)):
        if data.get(key) is not None:
            # any scalar passes: its parse refuses a wrong one as it refuses the same value in a mapping
            # (zero: 3.0 and zero: {stage: 3.0} are one answer)
            if not isinstance(data[key], (dict, int, float, str)):
                raise _err("bad-type", f"{key} must be a mapping or a scalar, got {cut(data[key])}", key,
                           "write zero: {stage: 3, axes: [dp]} or recompute: {mode: selective, layers: [l0]}")
            g.meta[meta_key] = data[key]
    return g
