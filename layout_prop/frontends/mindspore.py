"""MindSpore frontend: ``from_cell(cell, *example_inputs, plan=...)`` and ``from_mindir(path, plan)``.

``from_cell`` exports the cell with ``mindspore.export(..., file_format="MINDIR")`` into a
temporary folder (removed after) and reads the file; ``from_mindir`` reads an existing
``.mindir``.  The file is parsed with the protobuf schema MindSpore ships
(``mindspore.train.mind_ir_pb2``): the graph's inputs and parameters carry their shapes,
each node its output shape (a ``shape`` attribute), constants are ``Constant`` nodes.

Structural nodes (``Load``, ``UpdateState``, ``Depend``, ``MakeTuple``, ``TupleGetItem``)
are resolved away; scalar and tuple constants fold into attrs; parameter and input names
lose the graph prefix MindSpore gives them (``12_11_1___main___Net_construct_3:q.weight``
-> ``q.weight``), so they are the cell paths the plan's patterns match.  A ``Dense`` on a
3-D input is exported as ``Reshape(-1, in)``, ``MatMul(transpose_b)``, ``Reshape``; the
canonicalisation pass folds it back into ``linear`` on the 3-D input.

MindSpore's own sharding strategies: a primitive's ``shard()`` is saved (on CPU too) as its
``in_strategy`` attribute, split counts per dim of each input.  They are not imported as
layouts (a strategy names no mesh axes); each one on a graph input or parameter is
compared with the plan's layout of it, and a disagreement is an import note.

A damaged file is one typed error, never an internal one: tensor data is held to the bounds
the ONNX reader uses too (:mod:`~layout_prop.frontends.limits`: dims, data that fits them,
constants of at most 2^24 elements when filled, all checked before anything is allocated),
and what the later passes rely on is checked as it is read (a primitive's input count, a
product's output shape against its operands', a transpose's permutation).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from layout_prop.core.errors import SpecError, cut
from layout_prop.core.spec import numpy_dtype
from layout_prop.core.graph import Graph
from layout_prop.io.loader import MAX_ATTR_ITEMS
from layout_prop.io.plan_file import ShardingPlan, load_plan
from . import limits, read_model_bytes
from .ir import WHY_UNMAPPED, MNode, ModelGraph, Value, sanitize

__all__ = ["from_cell", "from_mindir", "read_mindir"]

# mind_ir TensorProto.DataType -> numpy dtype name
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
           11: "float64", 17: "float64", 16: "bfloat16"}
_SUPPORTED = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool")
_GRAPH_PREFIX = re.compile(r"^\d+(_\d+)*_.*construct")  # 12_11_1___main___Net_construct_3
_FA_LAYOUTS = {0: "BSH", 1: "BNSD", 2: "SBH", 3: "BSND", 4: "TND"}  # FlashAttentionScore's input_layout enum


def _schema():
    """MindSpore's ``mind_ir_pb2``, loaded from its file without importing MindSpore itself.

    Importing MindSpore takes seconds, and it sets ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``
    so that protobuf, imported after it, parses in pure Python (1 s for a 32-layer model instead
    of 5 ms).  The generated module needs only protobuf.
    """
    module = sys.modules.get("mindspore.train.mind_ir_pb2") or sys.modules.get(_SCHEMA_MODULE)
    if module is not None:
        return module
    found = importlib.util.find_spec("mindspore")
    locations = list(found.submodule_search_locations or ()) if found is not None else []
    path = next((Path(p) / "train" / "mind_ir_pb2.py" for p in locations
                 if (Path(p) / "train" / "mind_ir_pb2.py").is_file()), None)
    if path is None:
        raise SpecError("missing-dependency", "reading MindIR models needs MindSpore (its protobuf schema)",
                        hint="pip install 'layout-prop[mindspore]'")
    spec = importlib.util.spec_from_file_location(_SCHEMA_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_SCHEMA_MODULE] = module
    return module


_SCHEMA_MODULE = "layout_prop_mind_ir_pb2"


_HINT = "re-export the cell with mindspore.export(..., file_format='MINDIR')"


def _bad(message: str, source: str, hint: str = _HINT) -> SpecError:
    return SpecError("bad-model", message, path=source, hint=hint)


def _user_name(name: str) -> str:
    """``12_11_1___main___Net_construct_3:layers.0.wq.weight`` -> ``layers.0.wq.weight``."""
    head, sep, tail = name.partition(":")
    return tail if sep and _GRAPH_PREFIX.match(head) else name


def _node_name(name: str, prim: str) -> str:
    """A readable node name: the variable name MindSpore kept (``CNode_43$q:15`` -> ``q``), else
    the primitive and its number (``CNode_45:12`` -> ``reshape_12``)."""
    short = _user_name(name)
    base, _, number = short.rpartition(":")
    if not base:  # a name of our own (a Dense's cell path)
        return short
    if "$" in base:
        return base.split("$")[-1]
    return f"{prim.lower()}_{number or base}"


def _scope_name(domain: str) -> str | None:
    """A node name from MindSpore's scope: ``Default/layers-CellList/0-Block/attention-Attention/
    Reshape-op1`` -> ``layers.0.attention/Reshape_1`` (None without a scope)."""
    parts = [p for p in domain.split("/") if p]
    if not parts or "-op" not in parts[-1]:
        return None
    if parts[0] == "Default":
        parts = parts[1:]
    prim, _, number = parts[-1].rpartition("-op")
    op = prim if number in ("", "0") else f"{prim}_{number}"
    cell = ".".join(p.split("-")[0] for p in parts[:-1])
    return f"{cell}/{op}" if cell else op


def _tensor_array(t, source: str, what: str) -> np.ndarray:
    """A tensor's value under the readers' shared bounds (:mod:`~layout_prop.frontends.limits`,
    checked before anything is allocated): its raw data, else its typed values, each exactly what
    its dims and data type take (``bad-model`` otherwise); a tensor saved without data is zeros
    of its shape, of at most ``MAX_CONSTANT_ELEMENTS`` (``too-large`` past it)."""
    dtype = _DTYPES.get(t.data_type)
    if dtype is None:
        raise SpecError("unsupported-dtype", f"{what} has MindIR data type {t.data_type}",
                        path=source, hint="export the cell in float32 (or float16/bfloat16/float64)")
    if dtype == "bfloat16":
        dtype = numpy_dtype(dtype)  # ml_dtypes.bfloat16: numpy has none of its own
    if t.raw_data:
        return limits.from_bytes(t.raw_data, t.dims, dtype, what, source, _HINT)
    for field in ("float_data", "int64_data", "int32_data", "double_data"):
        values = getattr(t, field)
        if len(values):
            return limits.from_values(values, t.dims, dtype, what, source, _HINT)
    return limits.zeros(t.dims, dtype, what, source, _HINT)


def _attr_value(attr, source: str, what: str = "a constant") -> Any:
    """A Constant node's value as Python (a number, bool, tuple, numpy array, or None); ``what``
    names it in messages."""
    kind = attr.type
    if kind == 1:  # FLOAT (a float32: its shortest decimal, 1e-06 rather than 9.99999997e-07)
        return float(str(np.float32(attr.floats[0] if len(attr.floats) and not attr.f else attr.f)))
    if kind == 11:  # DOUBLE
        return attr.doubles[0] if len(attr.doubles) and not attr.d else attr.d
    if kind in (2, 3, 4, 5, 6, 7, 12, 13):  # integers: in i, or in ints inside a tuple
        return int(attr.ints[0]) if len(attr.ints) and not attr.i else int(attr.i)
    if kind == 9:
        return bool(attr.ints[0]) if len(attr.ints) and not attr.i else bool(attr.i)
    if kind == 8:
        return attr.s.decode() if isinstance(attr.s, bytes) else attr.s
    if kind in (20, 21):  # TUPLE, LIST
        return tuple(_attr_value(v, source, what) for v in attr.values)
    if kind == 17 and attr.HasField("t"):
        return _tensor_array(attr.t, source, what)
    if kind == 19 and len(attr.tensors):
        return _tensor_array(attr.tensors[0], source, what)
    if kind in (23, 24, 25):  # monads, None
        return None
    if len(attr.ints):
        return tuple(int(i) for i in attr.ints)
    if len(attr.floats):
        return tuple(float(f) for f in attr.floats)
    return None


class _Reader:
    """Turns one MindIR graph into a ModelGraph."""

    def __init__(self, model, source: str) -> None:
        self.model = model
        self.source = source
        self.g = ModelGraph("mindir")
        self.alias: dict[str, str] = {}      # structural node -> the value it stands for
        self.py: dict[str, Any] = {}         # constant name -> Python value
        self.tuples: dict[str, list[str]] = {}  # MakeTuple / multi-output op -> element values
        self.taken: set[str] = set()
        # MindSpore shard() strategies, saved as the primitives' in_strategy attribute
        self.strategies = {p.name: self.constant(a, f"the in_strategy of primitive {p.name!r}")
                           for p in model.primitives for a in p.attribute if a.name == "in_strategy"}

    def constant(self, attr, what: str) -> Any:
        """:func:`_attr_value`, with what a damaged value raises (undecodable text, a tuple nested
        past the recursion limit) turned into ``bad-model`` naming ``what``."""
        try:
            return _attr_value(attr, self.source, what)
        except (TypeError, ValueError, IndexError, AttributeError, RecursionError) as exc:
            raise _bad(f"cannot read {what} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                       [:600], self.source) from None

    def name(self, raw: str, prim: str) -> str:
        base = _node_name(raw, prim)
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def resolve(self, raw: str) -> str:
        seen = set()
        while raw in self.alias and self.alias[raw] != raw:
            if raw in seen:
                raise _bad(f"the structural nodes around {raw!r} form a cycle", self.source)
            seen.add(raw)
            raw = self.alias[raw]
        return raw

    def read(self) -> ModelGraph:
        graph = self.model.graph
        if not graph.node:
            raise _bad(f"{self.source!r} holds no graph nodes (a truncated file or another format)", self.source)
        names = [v.name for v in (*graph.input, *graph.parameter, *graph.output)]
        for node in graph.node:
            names += [node.name, node.op_type, node.domain, *node.input, *node.output]
        if not all(isinstance(n, str) for n in names):  # proto2 hands out invalid UTF-8 as bytes
            raise _bad(f"{self.source!r} holds names that are not UTF-8 text (a damaged file)", self.source)
        for inp in graph.input:
            if not len(inp.tensor) or not len(inp.tensor[0].dims) and inp.tensor[0].data_type == 0:
                raise _bad(f"input {_user_name(inp.name)!r} has no shape", self.source)
            t = inp.tensor[0]
            dims = [int(d) for d in t.dims]
            if any(d < 0 for d in dims):
                raise SpecError("dynamic-shape", f"input {_user_name(inp.name)!r} has dynamic dims {dims}",
                                path=self.source, hint="export the cell with example inputs of static shape")
            limits.tensor_dims(dims, f"input {_user_name(inp.name)!r}", self.source, _HINT)
            dtype = self.dtype(t.data_type, f"input {_user_name(inp.name)!r}")
            name = _user_name(inp.name)
            self.alias[inp.name] = name
            self.g.add_value(Value(name, tuple(dims), dtype))
            self.g.inputs.append(name)
        for p in graph.parameter:
            name = _user_name(p.name)
            self.alias[p.name] = name
            what = f"parameter {name!r}"
            dtype = self.dtype(p.data_type, what)
            # a weight kept outside the file (or not saved) is not read: a zero view of its shape, no memory
            value = limits.from_bytes(p.raw_data, p.dims, dtype, what, self.source, _HINT) if p.raw_data else \
                limits.unread(p.dims, dtype, what, self.source, _HINT)
            self.g.add_value(Value(name, tuple(value.shape), dtype, const=value, weight=True))
        self.taken.update(self.g.values)  # node names never shadow an input or a parameter
        for node in graph.node:
            self.node(node)
        outputs = []
        for o in graph.output:  # a cell returning a tuple returns a MakeTuple: its elements
            raw = self.resolve(o.name)
            outputs += self.tuples.get(o.name, self.tuples.get(raw, [raw]))
        self.g.outputs = [self.value_of(v) for v in outputs]
        return self.g

    def dtype(self, code: int, what: str) -> str:
        name = _DTYPES.get(code, f"type {code}")
        if name not in _SUPPORTED:
            raise SpecError("unsupported-dtype", f"{what} has dtype {name}", path=self.source,
                            hint="export the cell in float32 (or float16/bfloat16/float64)")
        if name == "bfloat16":
            numpy_dtype(name)  # ml_dtypes' type, under the name numpy then knows (the weights are read by name)
        return name

    def value_of(self, raw: str) -> str:
        name = self.resolve(raw)
        if name in self.py:  # a constant used as a tensor (the mask of an attention, say)
            value = self.py[name]
            if isinstance(value, np.ndarray):
                if name not in self.g.values:
                    self.g.add_value(Value(name, tuple(value.shape), str(value.dtype), const=value))
                return name
            raise _bad(f"constant {name!r} ({value!r}) is used as a tensor", self.source,
                       "pass tensors, not Python scalars, where the primitive takes a tensor")
        if name not in self.g.values:
            raise _bad(f"value {name!r} is used but never produced", self.source)
        return name

    def out_shape(self, node) -> tuple[tuple[int, ...], str] | None:
        for a in node.attribute:
            if a.name == "shape" and len(a.tensors) == 1:
                t = a.tensors[0]
                what = f"the output shape of node {node.name!r}"
                if any(d < 0 for d in t.dims):
                    raise SpecError("dynamic-shape", f"{what} has dynamic dims {cut(list(t.dims))}", path=self.source,
                                    hint="export the cell with example inputs of static shape")
                return limits.tensor_dims(t.dims, what, self.source, _HINT), _DTYPES.get(t.data_type, "float32")
        return None

    def node(self, node) -> None:
        prim = node.op_type.split("::")[-1].split(":")[0]
        out = node.output[0] if node.output else node.name
        if prim == "Constant":
            self.py[out] = self.constant(node.attribute[0], f"constant {_user_name(out)!r}") if node.attribute \
                else None
            return
        ins = [self.resolve(v) for v in node.input]
        if prim in ("Load", "Depend", "TupleGetItem") and len(ins) < (2 if prim == "TupleGetItem" else 1):
            raise _bad(f"node {node.name!r} ({prim}) has {len(ins)} inputs", self.source)
        if prim in ("Load", "Depend"):
            self.alias[out] = ins[0]
            return
        if prim == "UpdateState":
            return
        if prim == "MakeTuple":
            self.tuples[out] = ins
            return
        if prim == "TupleGetItem":
            index = self.py.get(ins[1])
            items = self.tuples.get(node.input[0], self.tuples.get(ins[0]))
            if items is None or not isinstance(index, int) or index >= len(items) or items[index] is None:
                raise SpecError("unknown-op", f"output {index} of {ins[0]!r} is not supported (only the first "
                                "output of RmsNorm and LayerNorm, and the pieces of Split)", path=self.source,
                                hint="use the primitive's main output only")
            self.alias[out] = items[index]
            return
        shaped = self.out_shape(node)
        handler = getattr(self, f"p_{prim}", None)
        name = self.name(_scope_name(node.domain) or out, prim)
        strategy = self.strategies.get(node.op_type.split("::")[-1])
        if strategy:
            self.g.declared.append((name, [v if v in self.g.values else None for v in ins[:len(strategy)]],
                                    strategy))
        try:
            if handler is None:
                return self.unknown(prim, name, ins, out, shaped)
            handler(name, ins, out, shaped)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as exc:
            # a constant of the wrong kind, too few inputs, shapes that do not go together
            raise _bad(f"cannot read node {name!r} ({prim}): its inputs or constants are not what {prim} takes "
                       f"({type(exc).__name__}: {exc})"[:600], self.source) from None

    # helpers --------------------------------------------------------------------
    def tensor(self, raw: str) -> str:
        return self.value_of(raw)

    def const(self, raw: str, default=None):
        return self.py.get(raw, default)

    def emit(self, name: str, op: str, inputs: list[str], out: str, shaped, attrs: dict | None = None,
             source: str = "", shape=None, dtype=None) -> str:
        if shape is None:
            if shaped is None:
                raise _bad(f"node {name!r} ({source}) has no output shape", self.source)
            shape, dtype = shaped[0], dtype or shaped[1]
        value = name
        self.g.add_value(Value(value, tuple(shape), dtype or "float32"))
        self.alias[out] = value
        self.g.nodes.append(MNode(name, op, inputs, [value], dict(attrs or {}), source))
        return value

    def unknown(self, prim, name, ins, out, shaped, why: str | None = None) -> None:
        """An unmapped node (``unknown-op``, or opaque with ``--opaque``); ``why`` it is, when known,
        rides along for the error to name."""
        tensors = [v for v in ins if v in self.g.values or isinstance(self.py.get(v), np.ndarray)]
        shape, dtype = shaped if shaped is not None else ((), "float32")
        self.emit(name, f"unmapped:{prim}", [self.value_of(v) for v in tensors], out, None,
                  {WHY_UNMAPPED: why} if why else {}, prim, shape=shape, dtype=dtype)

    def _simple(op: str, prim: str, arity: int = 2):  # noqa: N805 - a method factory
        def handler(self, name, ins, out, shaped):
            if len(ins) < arity:
                raise ValueError(f"{prim} takes {arity} inputs, not {len(ins)}")
            self.emit(name, op, [self.tensor(v) for v in ins[:arity]], out, shaped, {}, prim)
        return handler

    p_Add = _simple("add", "Add")
    p_AddExt = _simple("add", "AddExt")
    p_Sub = _simple("sub", "Sub")
    p_SubExt = _simple("sub", "SubExt")
    p_Mul = _simple("mul", "Mul")
    p_RealDiv = _simple("div", "RealDiv")
    p_Div = _simple("div", "Div")
    p_Neg = _simple("neg", "Neg", 1)
    p_Exp = _simple("exp", "Exp", 1)
    p_Sqrt = _simple("sqrt", "Sqrt", 1)
    p_Rsqrt = _simple("rsqrt", "Rsqrt", 1)
    p_Reciprocal = _simple("reciprocal", "Reciprocal", 1)
    p_SiLU = _simple("silu", "SiLU", 1)
    p_Sigmoid = _simple("sigmoid", "Sigmoid", 1)
    p_ReLU = _simple("relu", "ReLU", 1)
    p_Tanh = _simple("tanh", "Tanh", 1)
    p_Erf = _simple("erf", "Erf", 1)

    def p_GeLU(self, name, ins, out, shaped):
        self.emit(name, "gelu", [self.tensor(ins[0])], out, shaped, {}, "GeLU")

    def p_Muls(self, name, ins, out, shaped):
        self.emit(name, "scale", [self.tensor(ins[0])], out, shaped, {"factor": float(self.const(ins[1]))}, "Muls")

    def p_Pow(self, name, ins, out, shaped):
        exponent = self.const(ins[1])
        if exponent is not None and not isinstance(exponent, np.ndarray):
            c = self.g.fresh(f"{name}_exponent")
            self.g.add_value(Value(c, (), "float32", const=np.array(exponent, np.float32)))
            return self.emit(name, "pow", [self.tensor(ins[0]), c], out, shaped, {}, "Pow")
        self.emit(name, "pow", [self.tensor(ins[0]), self.tensor(ins[1])], out, shaped, {}, "Pow")

    def p_Square(self, name, ins, out, shaped):
        two = self.g.fresh(f"{name}_two")
        self.g.add_value(Value(two, (), "float32", const=np.array(2.0, np.float32)))
        self.emit(name, "pow", [self.tensor(ins[0]), two], out, shaped, {}, "Square")

    def p_Cast(self, name, ins, out, shaped):
        self.emit(name, "cast", [self.tensor(ins[0])], out, shaped, {"dtype": shaped[1]}, "Cast")

    def _product_shape(self, x: str, w: str, ta: bool, tb: bool, shaped) -> None:
        """The output shape the file gives a product of matrices is the one its operands give
        (the fusions that follow trust it): ValueError otherwise."""
        xs, ws = self.g.shape(x), self.g.shape(w)
        if len(xs) < 2 or len(ws) < 2 or shaped is None:
            return
        (m, k), (k2, n) = xs[-2:][::-1] if ta else xs[-2:], ws[-2:][::-1] if tb else ws[-2:]
        if k != k2:
            raise ValueError(f"operands of shapes {list(xs)} and {list(ws)} do not multiply")
        want = tuple(np.broadcast_shapes(xs[:-2], ws[:-2])) + (m, n)
        if tuple(shaped[0]) != want:
            raise ValueError(f"its output shape {cut(list(shaped[0]))} is not the {list(want)} its operands give")

    def _matmul(self, name, ins, out, shaped, prim):
        ta = bool(self.const(ins[2], False)) if len(ins) > 2 else False
        tb = bool(self.const(ins[3], False)) if len(ins) > 3 else False
        x, w = self.tensor(ins[0]), self.tensor(ins[1])
        self._product_shape(x, w, ta, tb, shaped)
        self.emit(name, "matmul_nd", [x, w], out, shaped, {"transpose_a": ta, "transpose_b": tb}, prim)

    def p_MatMul(self, name, ins, out, shaped):
        x, w = self.tensor(ins[0]), self.tensor(ins[1])
        ta = bool(self.const(ins[2], False)) if len(ins) > 2 else False
        tb = bool(self.const(ins[3], False)) if len(ins) > 3 else False
        self._product_shape(x, w, ta, tb, shaped)
        if tb and not ta and len(self.g.shape(w)) == 2 and self.g.values[w].weight:  # a Dense: x @ w.T
            cell = w[:-len(".weight")] if w.endswith(".weight") else f"{w}_linear"
            return self.emit(self.name(cell, "MatMul"), "linear", [x, w], out, shaped, {}, "MatMul")
        self.emit(name, "matmul_nd", [x, w], out, shaped, {"transpose_a": ta, "transpose_b": tb}, "MatMul")

    def p_BatchMatMul(self, name, ins, out, shaped):
        self._matmul(name, ins, out, shaped, "BatchMatMul")

    def p_MatMulExt(self, name, ins, out, shaped):
        self._matmul(name, ins[:2], out, shaped, "MatMulExt")

    def p_BiasAdd(self, name, ins, out, shaped):
        x, b = self.tensor(ins[0]), self.tensor(ins[1])
        if len(self.g.shape(x)) != 2:
            return self.unknown("BiasAdd", name, ins, out, shaped)
        self.emit(name, "add", [x, b], out, shaped, {}, "BiasAdd")

    def _axis(self, raw, rank: int):
        value = self.const(raw)
        if value is None or value == ():
            return None
        values = value if isinstance(value, tuple) else (value,)
        return [int(v) % rank for v in values]

    def p_Softmax(self, name, ins, out, shaped):
        axes = self._axis(ins[1], len(shaped[0])) if len(ins) > 1 else [len(shaped[0]) - 1]
        if axes is None or len(axes) != 1:
            return self.unknown("Softmax", name, ins, out, shaped)
        self.emit(name, "softmax", [self.tensor(ins[0])], out, shaped, {"axis": axes[0]}, "Softmax")

    def p_LogSoftmax(self, name, ins, out, shaped):
        axes = self._axis(ins[1], len(shaped[0])) if len(ins) > 1 else [len(shaped[0]) - 1]
        self.emit(name, "log_softmax", [self.tensor(ins[0])], out, shaped, {"axis": axes[0]}, "LogSoftmax")

    def _reduce(self, op, prim, name, ins, out, shaped):
        x = self.tensor(ins[0])
        rank = len(self.g.shape(x))
        dims = self._axis(ins[1], rank) if len(ins) > 1 else None
        keep = bool(self.const(ins[2], False)) if len(ins) > 2 else False
        self.emit(name, op, [x], out, shaped, {"dims": dims, "keepdim": keep}, prim)

    def p_ReduceSum(self, *a):
        self._reduce("sum", "ReduceSum", *a)

    def p_ReduceMean(self, *a):
        self._reduce("mean", "ReduceMean", *a)

    def p_MeanExt(self, *a):
        self._reduce("mean", "MeanExt", *a)

    def p_SumExt(self, *a):
        self._reduce("sum", "SumExt", *a)

    def p_ReduceMax(self, *a):
        self._reduce("max", "ReduceMax", *a)

    def p_RmsNorm(self, name, ins, out, shaped):
        x, w = self.tensor(ins[0]), self.tensor(ins[1])
        eps = float(self.const(ins[2], 1e-6))
        y = self.emit(name, "rms_norm", [x, w], out, None, {"eps": eps, "normalized_ndim": len(self.g.shape(w))},
                      "RmsNorm", shape=self.g.shape(x), dtype=self.g.values[x].dtype)
        self.tuples[out] = [y, None]

    def p_LayerNorm(self, name, ins, out, shaped):
        x, w, b = (self.tensor(v) for v in ins[:3])
        rank = len(self.g.shape(x))
        begin = self.const(ins[3], -1) if len(ins) > 3 else -1
        eps = float(self.const(ins[5], 1e-7)) if len(ins) > 5 else 1e-7
        y = self.emit(name, "layer_norm", [x, w, b], out, None, {"eps": eps, "normalized_ndim": rank - begin % rank},
                      "LayerNorm", shape=self.g.shape(x), dtype=self.g.values[x].dtype)
        self.tuples[out] = [y, None, None]

    def p_Reshape(self, name, ins, out, shaped):
        self.emit(name, "reshape", [self.tensor(ins[0])], out, shaped, {"shape": list(shaped[0])}, "Reshape")

    def p_Transpose(self, name, ins, out, shaped):
        x = self.tensor(ins[0])
        rank = len(self.g.shape(x))
        perm = [int(p) % rank if -rank <= int(p) < rank else int(p) for p in self.const(ins[1])]
        if sorted(perm) != list(range(rank)):
            raise ValueError(f"{cut(perm)} is not a permutation of the {rank} dims of {x!r}")
        self.emit(name, "transpose", [x], out, shaped, {"dims": perm}, "Transpose")

    def p_ExpandDims(self, name, ins, out, shaped):
        rank = len(shaped[0])
        self.emit(name, "unsqueeze", [self.tensor(ins[0])], out, shaped, {"dims": [int(self.const(ins[1])) % rank]},
                  "ExpandDims")

    def p_Squeeze(self, name, ins, out, shaped):
        x = self.tensor(ins[0])
        shape = self.g.shape(x)
        dims = self._axis(ins[1], len(shape)) if len(ins) > 1 else None
        dims = dims if dims else [i for i, s in enumerate(shape) if s == 1]
        self.emit(name, "squeeze", [x], out, shaped, {"dims": dims}, "Squeeze")

    def p_Concat(self, name, ins, out, shaped):
        items = self.tuples.get(ins[0], [ins[0]])
        axis = int(self.const(ins[1], 0)) if len(ins) > 1 else 0
        self.emit(name, "concat", [self.tensor(v) for v in items], out, shaped, {"axis": axis}, "Concat")

    def p_StridedSlice(self, name, ins, out, shaped):
        x = self.tensor(ins[0])
        begin, end, strides = (self.const(v) for v in ins[1:4])
        begin_mask, end_mask, *others = [int(self.const(v, 0) or 0) for v in ins[4:9]] + [0] * (5 - len(ins[4:9]))
        if begin is None or end is None or strides is None or any(others):  # ellipsis, new axis, shrink
            return self.unknown("StridedSlice", name, ins, out, shaped)
        shape = self.g.shape(x)
        begin = [None if begin_mask >> i & 1 else b for i, b in enumerate(begin)]  # a set bit: from the start
        end = [None if end_mask >> i & 1 else e for i, e in enumerate(end)]  # a set bit: to the end
        cuts = [(ax, *slice(b, e, s).indices(shape[ax])) for ax, (b, e, s) in enumerate(zip(begin, end, strides))
                if slice(b, e, s).indices(shape[ax]) != (0, shape[ax], 1)]
        if not cuts:
            return self.emit(name, "identity", [x], out, shaped, {}, "StridedSlice")
        src, cur = x, list(shape)
        for k, (ax, lo, hi, step) in enumerate(cuts):
            cur[ax] = len(range(lo, hi, step))
            op, attrs = ("slice", {"axis": ax, "start": lo, "stop": hi}) if step == 1 else \
                ("slice_step", {"axis": ax, "start": lo, "stop": hi, "step": step})
            last = k == len(cuts) - 1
            src = self.emit(name if last else self.name(f"{out}_{k}", "StridedSlice"), op, [src],
                            out if last else f"{out}__{k}", None, attrs, "StridedSlice", shape=list(cur),
                            dtype=self.g.values[x].dtype)

    def p_Split(self, name, ins, out, shaped):
        x = self.tensor(ins[0])
        shape = self.g.shape(x)
        axis = int(self.const(ins[1], 0)) % len(shape)
        n = int(self.const(ins[2], 1))
        if not 1 <= n <= MAX_ATTR_ITEMS:  # one value per piece, listed in the split's sizes
            raise ValueError(f"it splits into {n} pieces (1 to {MAX_ATTR_ITEMS})")
        if shape[axis] % n:
            return self.unknown("Split", name, ins, out, shaped)
        piece = list(shape)
        piece[axis] = shape[axis] // n
        outs = [self.g.add_value(Value(f"{name}_{i}", tuple(piece), self.g.values[x].dtype)) for i in range(n)]
        self.g.nodes.append(MNode(name, "split", [x], outs, {"axis": axis, "sizes": [piece[axis]] * n}, "Split"))
        self.tuples[out] = outs

    def p_BroadcastTo(self, name, ins, out, shaped):
        self.emit(name, "expand", [self.tensor(ins[0])], out, shaped, {}, "BroadcastTo")

    def p_Tile(self, name, ins, out, shaped):
        x = self.tensor(ins[0])
        multiples = [int(m) for m in self.const(ins[1])]
        if len(multiples) != len(self.g.shape(x)):
            return self.unknown("Tile", name, ins, out, shaped)
        self.emit(name, "tile", [x], out, shaped, {"multiples": multiples}, "Tile")

    def p_Gather(self, name, ins, out, shaped):
        table, ids = self.tensor(ins[0]), self.tensor(ins[1])
        axis = int(self.const(ins[2], 0)) if len(ins) > 2 else 0
        if axis == 0 and self.g.values[table].weight and len(self.g.shape(table)) == 2:
            return self.emit(name, "embedding", [ids, table], out, shaped, {}, "Gather")
        self.unknown("Gather", name, ins, out, shaped)

    def p_RotaryPositionEmbedding(self, name, ins, out, shaped):
        x, cos, sin = (self.tensor(v) for v in ins[:3])
        mode = int(self.const(ins[3], 0)) if len(ins) > 3 else 0
        self.emit(name, "rotary_position_embedding", [x, cos, sin], out, shaped, {"mode": mode},
                  "RotaryPositionEmbedding")

    def p_FlashAttentionScore(self, name, ins, out, shaped):
        """``(q, k, v, real_shift, drop_mask, padding_mask, attn_mask, prefix, actual_seq_qlen,
        actual_seq_kvlen, head_num, keep_prob, scale_value, pre_tokens, next_tokens, inner_precise,
        input_layout, sparse_mode)``; output 3 is the attention.

        Mapped to ``flash_attention_score`` with its attrs (:meth:`_flash_attrs`); attn_mask is its
        fourth operand in sparse modes 0 and 1 (modes 2 to 4 ignore it: MindSpore's compressed
        causal mask).  Dropout (keep_prob < 1) draws layout-prop's own mask, not drop_mask's (a
        note says so); padding_mask (reserved) and inner_precise (the kernel's precision) are not
        read.  What ``flash_attention_score`` does not take (:meth:`_flash_unsupported`) is left
        unmapped, with a note saying why.
        """
        q, k, v = (self.tensor(x) for x in ins[:3])
        attrs = self._flash_attrs(ins)
        why = self._flash_unsupported(ins, attrs)
        if why is not None:  # unmapped (opaque with --opaque); its attention is still output 3
            self.g.notes.append(f"node {sanitize(name)} (FlashAttentionScore) is left unmapped: {why}")
            self.unknown("FlashAttentionScore", name, ins, out, (self.g.shape(q), self.g.values[q].dtype), why)
            self.tuples[out] = [None, None, None, self.alias[out]]
            return
        operands = [q, k, v]
        if attrs["sparse_mode"] in (0, 1) and len(ins) > 6 and self.py.get(ins[6], "tensor") is not None:
            operands.append(self._attn_mask(ins[6]))
        if attrs["keep_prob"] != 1.0:
            self.g.notes.append(f"node {sanitize(name)} (FlashAttentionScore) drops probabilities (keep_prob="
                                f"{attrs['keep_prob']}): its draws are layout-prop's (the same on every layout), "
                                "not MindSpore's drop_mask")
        y = self.emit(name, "flash_attention_score", operands, out, None, attrs, "FlashAttentionScore",
                      shape=self.g.shape(q), dtype=self.g.values[q].dtype)
        self.tuples[out] = [None, None, None, y]

    def _attn_mask(self, raw: str) -> str:
        """FlashAttentionScore's attn_mask as an operand: a constant uint8 mask (MindSpore's usual, 1 where a
        query must not see a key) becomes bool, which ``flash_attention_score`` reads alike (nonzero: masked);
        uint8 is no dtype a spec takes, and the constant, read as a graph input, was ``bad-dtype``."""
        name = self.resolve(raw)
        value = self.py.get(name)
        if isinstance(value, np.ndarray) and value.dtype == np.uint8:
            self.py[name] = value.astype(np.bool_)
        return self.tensor(raw)

    def _flash_attrs(self, ins) -> dict:
        """FlashAttentionScore's constants as ``flash_attention_score``'s attrs: head_num, input_layout
        (MindSpore's enum as its name), scale (scale_value), keep_prob, sparse_mode, pre/next_tokens,
        and actual_seq_qlen/kvlen when they are constants."""
        layout = self.const(ins[16], "BSH") if len(ins) > 16 else "BSH"
        attrs = {"head_num": int(self.const(ins[10])), "input_layout": _FA_LAYOUTS.get(layout, layout),
                 "scale": float(self.const(ins[12], 1.0)) if len(ins) > 12 else 1.0,
                 "keep_prob": float(self.const(ins[11], 1.0)) if len(ins) > 11 else 1.0,
                 "sparse_mode": int(self.const(ins[17], 0)) if len(ins) > 17 else 0}
        for key, raw in zip(("pre_tokens", "next_tokens"), ins[13:15]):
            attrs[key] = int(self.const(raw, 2 ** 31 - 1))
        for key, raw in zip(("actual_seq_qlen", "actual_seq_kvlen"), ins[8:10]):
            ends = self.py.get(raw)
            if isinstance(ends, (tuple, list, np.ndarray)):
                if np.size(ends) > MAX_ATTR_ITEMS:  # one attr item per sequence
                    raise ValueError(f"its {key} has {np.size(ends)} sequences (at most {MAX_ATTR_ITEMS})")
                attrs[key] = [int(e) for e in np.asarray(ends).reshape(-1)]
        return attrs

    def _flash_unsupported(self, ins, attrs: dict) -> str | None:
        """Why a FlashAttentionScore node cannot be ``flash_attention_score``, or None."""
        if len(ins) > 3 and self.py.get(ins[3], "tensor") is not None:
            return "it adds a real_shift (a positional bias on the scores), which flash_attention_score does not take"
        if attrs["sparse_mode"] not in (0, 1, 2, 3, 4):
            return (f"sparse_mode {attrs['sparse_mode']} (5 to 8: a prefix or a varlen variant) is not one "
                    "flash_attention_score takes (0 band, 1 attn_mask only, 2 top-left causal, 3 bottom-right causal, "
                    "4 band from the bottom-right)")
        for key, raw in zip(("actual_seq_qlen", "actual_seq_kvlen"), ins[8:10]):
            if key not in attrs and self.py.get(raw, "tensor") is not None:
                return f"its {key} is a tensor computed at run time, where flash_attention_score takes constants"
        return None


def read_mindir(path: str | Path) -> ModelGraph:
    """Read a ``.mindir`` file into a :class:`ModelGraph` (no canonicalisation yet)."""
    schema = _schema()
    source = str(path)
    data = read_model_bytes(source, "give the path of a .mindir file")
    if data[:1] == b"\x08":  # field 1 as a number: ONNX's ir_version (MindIR's field 1 is its ir_version text)
        raise _bad(f"{source!r} is not a MindIR model: it starts as an ONNX model does", source,
                   "a .mindir file is what mindspore.export(..., file_format='MINDIR') writes; "
                   "name an ONNX model .onnx")
    model = schema.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:
        raise _bad(f"{source!r} is not a MindIR model ({type(exc).__name__})", source) from None
    if not model.ir_version:  # every MindIR file names its IR version; other protobuf files may parse
        raise _bad(f"{source!r} is not a MindIR model (no ir_version: another format)", source,
                   "a .mindir file is what mindspore.export(..., file_format='MINDIR') writes")
    if not model.HasField("graph") or not model.graph.node:
        raise _bad(f"{source!r} is not a MindIR model (no graph: a truncated file or another format)", source)
    return _Reader(model, source).read()


def from_mindir(path: str | Path, plan: ShardingPlan | str | Path | dict, *, opaque: bool = False, fuse: bool = True) -> Graph:
    """Import a ``.mindir`` file with a sharding plan (see :mod:`layout_prop.io.plan_file`)."""
    from . import build_graph

    plan = plan if isinstance(plan, ShardingPlan) else load_plan(plan)
    return build_graph(read_mindir(path), plan, opaque=opaque, fuse=fuse)


def from_cell(cell, *example_inputs, plan: ShardingPlan | str | Path | dict, opaque: bool = False,
              fuse: bool = True) -> Graph:
    """Export ``cell`` with ``example_inputs`` to MINDIR in a temporary folder and import it.

    Parameters
    ----------
    cell : mindspore.nn.Cell
    *example_inputs : mindspore.Tensor
        Inputs of static shape (their names in the plan are the ``construct`` arguments').
    plan : ShardingPlan, or a path, YAML/JSON text or dict of one
    """
    import mindspore

    folder = tempfile.mkdtemp(prefix="layout_prop_mindir_")
    try:
        try:
            mindspore.export(cell, *example_inputs, file_name=str(Path(folder) / "model"), file_format="MINDIR")
        except Exception as exc:  # MindSpore's own compile errors: one line, never a traceback
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError("export-failed", f"mindspore.export of {type(cell).__name__} failed: {first}",
                            hint="run the cell once in GRAPH_MODE on the example inputs to see the full error") \
                from None
        files = sorted(Path(folder).glob("*.mindir"))
        if not files:
            raise SpecError("export-failed", f"mindspore.export of {type(cell).__name__} wrote no .mindir file",
                            hint="check the cell exports with mindspore.export(..., file_format='MINDIR')")
        return from_mindir(files[0], plan, opaque=opaque, fuse=fuse)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
