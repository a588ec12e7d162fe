"""A reader for the plain block YAML that large specs are written in, line by line.

``layout-prop gen`` and ``yaml.dump`` write specs as block mappings and sequences with
flow lists and mappings of plain scalars at their leaves::

    nodes:
    - name: l0_q
      op: linear
      inputs: [l0_h, l0_wq]
      attrs: {}

Read through libyaml's events, such a spec costs about 17 Python event objects a node; read
here, one regular-expression match a line.  Only that shape is read: a text with a
comment, a quote, a tag, an anchor or alias, a block scalar, a tab, a carriage return, a
document marker, a trailing space, a multi-line scalar, a nested flow collection, a plain
scalar with a character outside ``[A-Za-z0-9_.()/+~-]``, a key longer than libyaml reads
(:data:`MAX_KEY`), nesting deeper than :data:`MAX_BLOCKS` or anything else gives None, and
the caller reads it with the YAML loader, which also reports every error.  What is read
is what the loader reads: each plain scalar (key or value) becomes its value through
``scalar``, which the caller makes from the same loader's resolver and constructor, and a
mapping that holds a key twice (as Python compares keys) gives None.

Examples
--------
>>> read_block_yaml("a:\\n- b: [1, x]\\n  c: {d: 2}\\ne:\\n", lambda s: int(s) if s.isdigit() else s)
{'a': [{'b': [1, 'x'], 'c': {'d': 2}}], 'e': None}
>>> read_block_yaml("a: 'quoted'\\n", str) is None
True
"""

from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["read_block_yaml"]

#: a plain scalar read here: it starts with no YAML indicator and holds no space, ':' or ','
#: (a lone "-", which would be a sequence entry, is refused when its value is asked for)
PLAIN = r"[A-Za-z0-9_()/+~-][A-Za-z0-9_.()/+~-]*"
#: a value on one line: a plain scalar, a flow list of them, or a flow mapping of them
_VALUE = rf"(?:({PLAIN})|\[((?:{PLAIN}(?:, {PLAIN})*)?)\]|\{{((?:{PLAIN}: {PLAIN}(?:, {PLAIN}: {PLAIN})*)?)\}})"
#: the whole grammar of a line: its indent, a sequence entry's "- ", then "key:" with or without
#: a value, or an entry's value.  Anything else (a comment, a quote, a tag, a tab, a trailing
#: space...) does not match.
_LINE = re.compile(rf"( *)(- )?(?:({PLAIN}):(?: +{_VALUE})?|{_VALUE})")


#: the longest implicit key libyaml reads (YAML's limit on a key written without "? ")
MAX_KEY = 1024
#: the most blocks open at once read here: libyaml refuses 1,000 nested collections, and a
#: text that nests deeper than this is left to it (a spec needs a few levels)
MAX_BLOCKS = 500


class _Outside(Exception):
    """The text is not in the shape read here."""


def read_block_yaml(text: str, scalar: Callable[[str], Any]) -> dict | None:
    """The mapping a block YAML ``text`` holds, or None when it is not in the shape read here.

    ``scalar`` turns a plain scalar's text into its value (the loader's resolution); it is
    called once per distinct text, and may raise to refuse the text (then None).
    """
    try:
        return _read(text, scalar)
    except (_Outside, RecursionError):
        return None
    except Exception:  # noqa: BLE001 - ``scalar`` refused a text (a number of 5,000 digits): the loader says why
        return None


def _value(plain: str | None, items: str | None, pairs: str | None, value_of: Callable[[str], Any]) -> Any:
    """The value of a line from the groups of :data:`_VALUE`: one of them is set."""
    if plain is not None:
        return value_of(plain)
    if items is not None:
        return list(map(value_of, items.split(", "))) if items else []
    mapping: dict = {}
    if pairs:
        for pair in pairs.split(", "):
            key, _, item = pair.partition(": ")
            if len(key) > MAX_KEY:
                raise _Outside
            key = value_of(key)
            if key in mapping:
                raise _Outside
            mapping[key] = value_of(item)
    return mapping


def _read(text: str, scalar: Callable[[str], Any]) -> dict:
    """Build the document from its lines with a stack of open blocks, each (column, container,
    whether it is a sequence).  A "key:" without a value leaves the key pending: the next
    line opens its block when it is deeper (or is a "- " entry at the key's own column, as
    ``yaml.dump`` writes sequences), else the key's value is null."""
    known: dict[str, Any] = {}  # a plain scalar's text -> its value

    def value_of(plain: str) -> Any:
        v = known.get(plain, known)
        if v is known:
            if plain == "-":  # a sequence entry without its space, or an empty one: the loader decides
                raise _Outside
            v = known[plain] = scalar(plain)
        return v

    root: dict = {}
    blocks: list[tuple[int, Any, bool]] = [(0, root, False)]
    column, container, in_list = 0, root, False
    pending: Any = _Outside  # the key of ``container`` whose value is the next block (none: _Outside)
    lines = 0
    match = _LINE.fullmatch
    for line in text.split("\n"):
        if not line:
            continue
        m = match(line)
        if m is None:
            raise _Outside
        lines += 1
        indent, dash, key, plain, items, pairs, item, item_items, item_pairs = m.groups()
        at = len(indent)
        if pending is not _Outside:  # (its value stays null unless this line opens its block)
            if at > column or (dash and at == column):
                if len(blocks) >= MAX_BLOCKS:
                    raise _Outside
                block: Any = [] if dash else {}
                container[pending] = block
                blocks.append((at, block, bool(dash)))
                column, container, in_list = at, block, bool(dash)
            pending = _Outside
        # close the blocks this line is left of; a key at the column of a sequence that was
        # written at its key's column closes the sequence
        while at < column or (at == column and in_list and not dash and len(blocks) > 1
                              and blocks[-2][0] == at):
            blocks.pop()
            column, container, in_list = blocks[-1]
        if at != column or in_list != bool(dash):
            raise _Outside
        if dash:
            if key is None:  # "- item"
                container.append(_value(item, item_items, item_pairs, value_of))
                continue
            entry: dict = {}  # "- key: ...": a mapping whose keys are two columns right of the dash
            container.append(entry)
            column, container, in_list = at + 2, entry, False
            blocks.append((column, entry, False))
        elif key is None:  # a line that is neither a key nor an entry (a multi-line scalar...)
            raise _Outside
        if len(key) > MAX_KEY:
            raise _Outside
        k = value_of(key)
        if k in container:
            raise _Outside
        if plain is not None:  # the common line: "key: scalar"
            container[k] = value_of(plain)
        elif items is None and pairs is None:  # "key:": null, or the block that follows
            container[k] = None
            pending = k
        else:
            container[k] = _value(None, items, pairs, value_of)
    if not lines:
        raise _Outside
    return root
