"""Fuzz the MindIR reader: mutants of ``examples/llama_block.mindir`` keep the exit-code contract.

Every mutant, whatever it holds, gives exit 0, 1 or 2; no ``Traceback``; at most one stderr
line, and on exit 2 exactly one, ``layout-prop: error: CODE ...``, never the catch-all
``internal-error`` (a bug) nor ``out-of-memory`` (something allocated before the reader
checked it); each in bounded time (:data:`SECONDS`).

The mutants are byte-level (bytes changed, the file cut short, a run of random bytes spliced
in) and structured, through the protobuf schema the reader parses with: a tensor's dims
(hostile sizes: negative, 2^31, 2^62, ...), its raw data (cut, odd lengths, dropped), its data
type, its typed values; a node's output shape, a constant's attribute kind and value, and the
graph itself (a node dropped, an input renamed, a primitive swapped).  The tensors are the
parameters, the graph inputs, the constants (the attention mask) and the nodes' shapes.

The mutants are seeded (:data:`SEED`): every CI run tries the same ones.  They run in one
child process whose address space is limited to :data:`ADDRESS_SPACE` (``resource.setrlimit``),
each through :func:`layout_prop.cli.main` in that process: an allocation of 64 GiB that the
reader should have refused fails there, as ``out-of-memory``, instead of taking the machine.
``LAYOUT_PROP_FUZZ_MINDIR=N`` tries N mutants (:data:`MUTANTS` by default) and
``LAYOUT_PROP_FUZZ_SEED=S`` other ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

if importlib.util.find_spec("mindspore") is None:  # the reader parses with MindSpore's schema (never imported)
    pytest.skip("reading MindIR needs MindSpore's protobuf schema", allow_module_level=True)

from layout_prop.frontends.mindspore import _schema  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama_block.mindir"
PLAN = ROOT / "examples" / "llama_plan.yaml"

#: mutants per CI run (about 5 ms each in the child: 1,000 in 5 s); more with LAYOUT_PROP_FUZZ_MINDIR
MUTANTS = int(os.environ.get("LAYOUT_PROP_FUZZ_MINDIR", "1000"))
SEED = int(os.environ.get("LAYOUT_PROP_FUZZ_SEED", "2024"))
#: the longest one mutant may take (a hang guard, generous: CI machines may be loaded)
SECONDS = 10.0
#: the child's address space: the interpreter with numpy takes about 150 MB of it, a constant
#: of the 2^24 elements the readers allow at most 128 MiB
ADDRESS_SPACE = 2 * 2 ** 30

# --------------------------------------------------------------------------- mutations

HOSTILE_DIMS = [0, 1, 3, 7, -1, -2 ** 63, 2 ** 17, 2 ** 31, 2 ** 32 + 1, 2 ** 62, 2 ** 63 - 1]
HOSTILE_SHAPES = [[], [0], [1], [2 ** 17, 2 ** 17], [2 ** 62, 32], [2 ** 31, 2 ** 31], [-1, 8], [1] * 40,
                  [2 ** 63 - 1], [4, 4], [8, 8, 0], [2 ** 24 + 1]]
HOSTILE_INTS = [0, 1, -1, 2, 3, 7, 2 ** 31, -2 ** 31, 2 ** 62, 2 ** 63 - 1, -2 ** 63]
DATA_TYPES = [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 14, 16, 17, 18, 99]
ATTR_TYPES = [0, 1, 2, 6, 7, 8, 9, 11, 17, 18, 19, 20, 21, 22, 23, 25, 30, 40]  # a closed enum: no unknown kinds
PRIMITIVES = ["Add", "MatMul", "Reshape", "Transpose", "Softmax", "Split", "Concat", "StridedSlice", "Tile",
              "Gather", "FlashAttentionScore", "TupleGetItem", "MakeTuple", "Load", "Depend", "Constant",
              "ExpandDims", "Squeeze", "Pow", "Muls", "RmsNorm", "LayerNorm", "ReduceSum", "Bogus"]


def _tensors(model) -> list[tuple[str, object]]:
    """Every tensor the reader reads, with its kind: parameters, inputs, constants, output shapes."""
    graph = model.graph
    found = [("parameter", p) for p in graph.parameter]
    found += [("input", t) for i in graph.input for t in i.tensor]
    for node in graph.node:
        for attr in node.attribute:
            kind = "shape" if attr.name == "shape" else "constant"
            found += [(kind, t) for t in attr.tensors]
            if attr.HasField("t"):
                found.append((kind, attr.t))
    return found


def _mutate_tensor(rng: random.Random, t) -> str:
    kind = rng.choice(["dim", "dims", "dims", "rank", "raw", "raw", "dtype", "values", "fill", "fit"])
    if kind == "dim" and len(t.dims):
        t.dims[rng.randrange(len(t.dims))] = rng.choice(HOSTILE_DIMS)
    elif kind in ("dims", "dim"):
        del t.dims[:]
        t.dims.extend(rng.choice(HOSTILE_SHAPES))
    elif kind == "rank":
        if len(t.dims) and rng.random() < 0.5:
            del t.dims[-1]
        else:
            t.dims.append(rng.choice([1, 2, 8]))
    elif kind == "raw":
        raw = t.raw_data
        choice = rng.randrange(5)
        t.raw_data = (raw[:rng.randrange(len(raw) + 1)], b"\0" * 7, b"", raw + raw, raw + b"\x01")[choice]
    elif kind == "dtype":
        t.data_type = rng.choice(DATA_TYPES)
    elif kind == "values":  # typed values in place of raw data, too few, too many or just enough
        count = max(1, len(t.raw_data) // 4) if rng.random() < 0.3 else rng.choice([0, 1, 3, 16, 64, 1025])
        t.raw_data = b""
        rng.choice([t.float_data, t.int64_data, t.int32_data, t.double_data]).extend([1] * count)
    elif kind == "fill":  # no data at all: a constant of zeros of a (maybe huge) shape
        t.raw_data = b""
        del t.dims[:]
        t.dims.extend(rng.choice(HOSTILE_SHAPES))
    else:  # dims that fit the data in another arrangement, or a small shape with the old data
        del t.dims[:]
        t.dims.extend(rng.choice([[len(t.raw_data) // 4], [len(t.raw_data)], [2, 2]]))
    return kind


def _mutate_attribute(rng: random.Random, attr) -> str:
    kind = rng.choice(["type", "int", "ints", "values", "clear"])
    if kind == "type":
        attr.type = rng.choice(ATTR_TYPES)
    elif kind == "int":
        attr.i = rng.choice(HOSTILE_INTS)
    elif kind == "ints":
        del attr.ints[:]
        attr.ints.extend(rng.choice(HOSTILE_INTS) for _ in range(rng.randrange(4)))
    elif kind == "values":
        if len(attr.values):
            del attr.values[rng.randrange(len(attr.values))]
        else:
            attr.values.add(type=rng.choice(ATTR_TYPES), i=rng.choice(HOSTILE_INTS))
    else:
        attr.Clear()
    return f"attr-{kind}"


def _mutate_graph(rng: random.Random, model) -> str:
    nodes = model.graph.node
    node = nodes[rng.randrange(len(nodes))]
    kind = rng.choice(["drop-node", "duplicate-node", "rename-input", "drop-input", "primitive", "attribute",
                       "drop-parameter", "drop-output"])
    if kind == "drop-node" and len(nodes) > 1:
        del nodes[rng.randrange(len(nodes))]
    elif kind == "duplicate-node":
        nodes.add().CopyFrom(node)
    elif kind == "rename-input" and len(node.input):
        others = [n.output[0] for n in nodes if n.output] + [p.name for p in model.graph.parameter]
        node.input[rng.randrange(len(node.input))] = rng.choice(others + ["nowhere"])
    elif kind == "drop-input" and len(node.input):
        del node.input[rng.randrange(len(node.input))]
    elif kind == "primitive":
        node.op_type = "REF::" + rng.choice(PRIMITIVES)
    elif kind == "attribute" and len(node.attribute):
        return _mutate_attribute(rng, node.attribute[rng.randrange(len(node.attribute))])
    elif kind == "drop-parameter" and len(model.graph.parameter):
        del model.graph.parameter[rng.randrange(len(model.graph.parameter))]
    elif kind == "drop-output" and len(model.graph.output):
        del model.graph.output[:]
    return kind


def _damage_bytes(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    damaged = bytearray(data)
    kind = rng.choice(["flip", "cut", "splice"])
    if kind == "flip":
        for _ in range(rng.randint(1, 20)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
    elif kind == "cut":
        damaged = damaged[:rng.randrange(len(damaged))]
    else:
        at = rng.randrange(len(damaged))
        damaged[at:at + rng.randint(1, 200)] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 50)))
    return kind, bytes(damaged)


def mutants(count: int, seed: int) -> list[tuple[str, bytes]]:
    """``count`` seeded mutants of the example: ``(what was done, the file's bytes)``."""
    data = EXAMPLE.read_bytes()
    schema = _schema()
    base = schema.ModelProto()
    base.ParseFromString(data)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.25:
            kind, damaged = _damage_bytes(rng, data)
            out.append((f"bytes-{kind}", damaged))
            continue
        model = schema.ModelProto()
        model.CopyFrom(base)
        kinds = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            if rng.random() < 0.7:  # a tensor of each kind as often (the one constant as often as a parameter)
                tensors = _tensors(model)
                where = rng.choice(sorted({w for w, _ in tensors}))
                tensor = rng.choice([t for w, t in tensors if w == where])
                kinds.append(f"{where}-{_mutate_tensor(rng, tensor)}")
            else:
                kinds.append(_mutate_graph(rng, model))
        out.append(("+".join(kinds), model.SerializeToString()))
    return out


# --------------------------------------------------------------------------- the guarded child

_CHILD = r"""
import contextlib, io, json, resource, sys, time
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from layout_prop.cli import main
plan = sys.argv[2]
for path in sys.argv[4:]:
    print(json.dumps({"start": path}), flush=True)  # a crash of the child names the model it was on
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", path, "--plan", plan])
    seconds = time.perf_counter() - start
    print(json.dumps({"path": path, "rc": rc, "err": err.getvalue()[:2000], "seconds": seconds,
                      "traceback": "Traceback" in out.getvalue() + err.getvalue()}), flush=True)
"""


def run_guarded(paths: list[Path], plan: Path = PLAN) -> dict[str, dict]:
    """``layout-prop check PATH --plan PLAN`` on each path, in-process in one child with a limited
    address space: ``{path: {"rc", "err", "seconds", "traceback"}}`` (stderr cut to 2,000 characters)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, "", str(plan), str(ADDRESS_SPACE), *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, errors="replace")
    results, last = {}, None
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if "start" in record:
            last = record["start"]
        else:
            results[record.pop("path")] = record
    assert proc.returncode == 0 and len(results) == len(paths), \
        f"the child died (rc {proc.returncode}) on {last}: {proc.stderr[-3000:]}"
    return results


def outcome(record: dict) -> str:
    """``violations``/``ok`` for exit 1/0, the error code for exit 2."""
    if record["rc"] != 2:
        return {0: "ok", 1: "violations"}.get(record["rc"], f"exit {record['rc']}")
    return record["err"].split(": ")[2].split(" ")[0] if record["err"].count(": ") >= 2 else record["err"]


def broken(record: dict) -> str | None:
    """What breaks the exit-code contract in one run, or None."""
    rc, err = record["rc"], record["err"]
    if rc not in (0, 1, 2):
        return f"exit {rc}"
    if record["traceback"]:
        return "a traceback"
    if len(err.splitlines()) > 1:  # a warning line besides the result, say
        return f"{len(err.splitlines())} stderr lines"
    if rc == 2:
        lines = err.splitlines()
        if len(lines) != 1 or not lines[0].startswith("layout-prop: error: "):
            return f"{len(lines)} stderr lines"
        if outcome(record) in ("internal-error", "out-of-memory"):
            return outcome(record)
    if record["seconds"] > SECONDS:
        return f"{record['seconds']:.1f} s"
    return None


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mindir_fuzz")
    made = []
    for k, (what, data) in enumerate(mutants(MUTANTS, SEED)):
        path = folder / f"m{k:04d}.mindir"
        path.write_bytes(data)
        made.append((path, what))
    results = run_guarded([p for p, _ in made])
    return [(what, results[str(p)]) for p, what in made]


def test_mutated_mindir_models_keep_the_exit_code_contract(fuzzed):
    failures = [(what, why, record["err"][:300]) for what, record in fuzzed if (why := broken(record))]
    summary = Counter(outcome(r) for _, r in fuzzed)
    assert not failures, f"{len(failures)} of {len(fuzzed)} mutants broke the contract ({dict(summary)}):\n" + \
        "\n".join(f"{what}: {why}: {err}" for what, why, err in failures[:20])
    assert summary["bad-model"] >= len(fuzzed) // 4, summary  # many mutants break the model itself
    assert summary["violations"] + summary["ok"] >= len(fuzzed) // 10, summary  # and many still reach the analysis


# --------------------------------------------------------------------------- what the fuzz found


def _edited(edit) -> bytes:
    """The example with ``edit(model)`` applied to its parsed protobuf."""
    model = _schema().ModelProto()
    model.ParseFromString(EXAMPLE.read_bytes())
    edit(model)
    return model.SerializeToString()


def _mask(model):
    """The example's one tensor constant: the attention's causal mask, (8, 8) float32."""
    (node,) = [n for n in model.graph.node if n.op_type.endswith("Constant") and n.output[0] == "other_31"]
    return node.attribute[0].tensors[0]


def _weight(model, name: str):
    return next(p for p in model.graph.parameter if p.name.endswith(":" + name))


def _seven_bytes(model):
    mask = _mask(model)
    del mask.dims[:]
    mask.dims.extend([4, 4])
    mask.raw_data = b"\0" * 7


def _huge_parameter(model):
    w = _weight(model, "layers.0.attention.wq.weight")
    del w.dims[:]
    w.dims.extend([2 ** 62, 32])
    w.raw_data = b"\0" * 1024


def _empty_64_gib_constant(model):
    mask = _mask(model)
    del mask.dims[:]
    mask.dims.extend([2 ** 17, 2 ** 17])
    mask.raw_data = b""


#: the fuzz's findings: each was an internal error or a 64 GiB allocation
REGRESSIONS = {
    "constant-7-bytes": (_seven_bytes, "bad-model", "constant 'other_31' has data that does not fit its dims [4, 4] "
                         "and data type float32 (7 bytes given, 64 needed)"),
    "parameter-2^62-rows": (_huge_parameter, "bad-model", "parameter 'layers.0.attention.wq.weight' has data that "
                            "does not fit its dims [4611686018427387904, 32] and data type float32 (1,024 bytes "
                            "given, 590,295,810,358,705,651,712 needed)"),
    "constant-64-GiB-of-zeros": (_empty_64_gib_constant, "too-large", "constant 'other_31' is saved without data: "
                                 "filling it with zeros would give shape [131072, 131072] (17,179,869,184 elements), "
                                 "over the 16,777,216 (2^24) elements a filled constant may hold"),
}


@pytest.fixture(scope="module")
def regressions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mindir_regressions")
    paths = {}
    for case, (edit, _, _) in REGRESSIONS.items():
        paths[case] = folder / f"{case}.mindir"
        paths[case].write_bytes(_edited(edit))
    results = run_guarded(list(paths.values()))  # the 64 GiB constant: refused, or out-of-memory in the child
    return {case: (path, results[str(path)]) for case, path in paths.items()}


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_what_the_fuzz_found_is_one_typed_line(regressions, case):
    path, record = regressions[case]
    _, code, message = REGRESSIONS[case]
    assert record["rc"] == 2 and broken(record) is None, record
    assert record["err"].startswith(f"layout-prop: error: {code} at {path}: {message} (hint: "), record["err"]
    assert record["seconds"] < 2.0, record


def test_the_mutants_are_seeded():
    assert mutants(20, SEED) == mutants(20, SEED)
    assert mutants(20, SEED) != mutants(20, SEED + 1)


if __name__ == "__main__":  # a longer hunt: python -m graph_tests.test_fuzz_mindir [COUNT] [SEED]
    import tempfile

    count, seed = int(sys.argv[1]) if len(sys.argv) > 1 else MUTANTS, int(sys.argv[2]) if len(sys.argv) > 2 else SEED
    with tempfile.TemporaryDirectory() as tmp:
        made = []
        for k, (what, data) in enumerate(mutants(count, seed)):
            path = Path(tmp) / f"m{k:04d}.mindir"
            path.write_bytes(data)
            made.append((path, what))
        results = run_guarded([p for p, _ in made])
        for path, what in made:
            record = results[str(path)]
            why = broken(record)
            if why:
                print(f"{path.name} {what}: {why}: {record['err'].strip()[:300]}")
        print(dict(Counter(outcome(results[str(p)]) for p, _ in made)))
