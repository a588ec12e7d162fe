"""ONNX frontend: ``from_onnx(path_or_model, plan) -> Graph``.

Shapes come from ``onnx.shape_inference`` (dynamic input dims are fixed first from the
plan's ``inputs.NAME.shape``); shape subgraphs (``Shape``, ``Gather`` on shapes,
``Concat`` of constants, ``Range``, ``Trilu``...) fold to constants; each remaining node
becomes a neutral :class:`~layout_prop.frontends.ir.MNode`, the canonicalisation pass
fuses the decomposed patterns torch.onnx.export writes (RMSNorm, rotate-half RoPE,
SiLU, attention) and :func:`~layout_prop.frontends.ir.to_spec` lowers the rest.

Needs the ``onnx`` package (``pip install 'layout-prop[onnx]'``).
"""

from __future__ import annotations

import ast
import functools
import math
import re
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from layout_prop.core.errors import SpecError
from layout_prop.core.graph import Graph
from layout_prop.core.spec import is_float_dtype
from layout_prop.io.plan_file import ShardingPlan, load_plan
from . import limits, read_model_bytes
from .ir import MNode, ModelGraph, Value, scalar_value

__all__ = ["from_onnx", "read_onnx"]


@lru_cache(maxsize=None)  # called per node: the import statements cost more than the lookup
def _onnx():
    try:
        import onnx  # noqa: F401
        import onnx.numpy_helper  # noqa: F401
        import onnx.shape_inference  # noqa: F401
    except ImportError:
        raise SpecError("missing-dependency", "reading ONNX models needs the onnx package",
                        hint="pip install 'layout-prop[onnx]'") from None
    return onnx


_HINT = "re-export the model with torch.onnx.export, or check the file"


def _bad(message: str, source: str, hint: str = _HINT) -> SpecError:
    return SpecError("bad-model", message, path=source, hint=hint)


def _load(path_or_model: Any) -> tuple[Any, str]:
    onnx = _onnx()
    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model, "<model>"
    source = str(path_or_model)
    data = read_model_bytes(source, "give the path of an .onnx file")
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf's DecodeError and friends: truncated or not ONNX
        why = str(exc).splitlines()[0] if str(exc).strip() else "cannot parse"
        raise _bad(f"{source!r} is not an ONNX model ({type(exc).__name__}: {why})", source) from None
    if not model.ir_version or not model.graph.node:
        raise _bad(f"{source!r} is not an ONNX model (no IR version or no nodes: a truncated file or another format)",
                   source)
    return model, source


@lru_cache(maxsize=None)
def _dtype_name(elem_type: int) -> str:
    try:
        return str(np.dtype(_onnx().helper.tensor_dtype_to_np_dtype(elem_type)))
    except Exception:
        return f"onnx type {elem_type}"


def _dtype(elem_type: int, what: str, source: str) -> str:
    name = _dtype_name(elem_type)
    if name not in ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"):
        raise SpecError("unsupported-dtype", f"{what} has dtype {name}", path=source,
                        hint="export the model in float32 (or float16/bfloat16/float64)")
    return name


def _first_line(exc: Exception) -> str:
    """What an exception says, on one line (its class name when it says nothing)."""
    return (str(exc).splitlines() or [""])[0] or type(exc).__name__


# ----------------------------------------------------------------------------- tensors
SMALL_EXTERNAL = 1024  # bytes: an externally stored tensor this small is read (shapes, axes, scalars, eps);
# onnx.save puts tensors under this size (its default threshold) in the model file anyway


def _tensor_dtype(tensor, what: str, source: str) -> np.dtype:
    try:
        return np.dtype(_onnx().helper.tensor_dtype_to_np_dtype(tensor.data_type))
    except Exception:
        raise _bad(f"{what} has data type {tensor.data_type}, which ONNX does not define", source) from None


def _tensor_dims(tensor, what: str, source: str) -> tuple[int, ...]:
    return limits.tensor_dims(tensor.dims, what, source, _HINT)


def _data_bits(tensor) -> int | None:
    """Bits per element of a packed data type (INT4, FLOAT6E2M3...: several to a byte), else None."""
    t = _onnx().TensorProto
    packed = {"UINT4": 4, "INT4": 4, "FLOAT4E2M1": 4, "UINT2": 2, "INT2": 2, "FLOAT6E2M3": 6, "FLOAT6E3M2": 6}
    return next((bits for name, bits in packed.items() if getattr(t, name, None) == tensor.data_type), None)


def _read_external(tensor, base: str | None, what: str, source: str) -> None:
    """The one rule for a tensor whose data is in an external data file, whatever holds it
    (an initializer, a ``Constant``'s ``value``, ``ConstantOfShape``'s ``value``, any tensor
    attribute): a tensor of at most :data:`SMALL_EXTERNAL` bytes is read, exactly its bytes,
    from a regular file beside the model (``base``, the model's folder; onnx refuses absolute
    paths, ``..``, links and devices), into the tensor itself; a larger one is never read
    (only its shape and dtype are used). A model given in memory has no folder: its small
    external tensors are refused rather than looked for in the current folder."""
    onnx = _onnx()
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return
    dims = _tensor_dims(tensor, what, source)
    size = -(-math.prod(dims) * (_data_bits(tensor) or _tensor_dtype(tensor, what, source).itemsize * 8) // 8)
    if size > SMALL_EXTERNAL:
        return
    if base is None:
        raise _bad(f"{what} is stored in an external data file, and a model given in memory has no folder "
                   "to find it in", source, "pass the model's path instead (its external data files are read "
                   "from beside it), or load it with onnx.load, which reads them")
    entries = {e.key: e.value for e in tensor.external_data}
    if "length" in entries and entries["length"].strip() != str(size):
        raise _bad(f"{what} is stored in an external data file with length {entries['length'][:40]!r}, but its "
                   f"dims {list(dims)} take {size} bytes", source, "re-export the model (its external data is damaged)")
    del tensor.external_data[:]
    for key, value in entries.items():
        if key != "length":
            tensor.external_data.add(key=key, value=value)
    tensor.external_data.add(key="length", value=str(size))  # read exactly these bytes, never the whole file
    from onnx.external_data_helper import load_external_data_for_tensor

    try:
        with warnings.catch_warnings():  # onnx warns of unknown keys: no line on stderr
            warnings.simplefilter("ignore")
            load_external_data_for_tensor(tensor, base)
    except Exception as exc:  # OSError, ValueError, or onnx's ValidationError (absolute, outside, a link...)
        why = getattr(exc, "strerror", None) or _first_line(exc)
        raise _bad(f"{what} is stored in an external data file that cannot be read ({why})"[:600], source,
                   "keep the model's external data files beside it") from None


def _tensor_array(tensor, what: str, source: str) -> tuple[np.ndarray, bool]:
    """A tensor's value, and whether its data was read, under the readers' shared bounds
    (:mod:`~layout_prop.frontends.limits`, checked before anything is allocated): a tensor still
    in an external data file (over :data:`SMALL_EXTERNAL` bytes, see :func:`_read_external`) is a
    read-only array of zeros of its shape that takes no memory, and is never read; a tensor whose
    data does not fit its dims and data type is ``bad-model``."""
    onnx = _onnx()
    dims, dtype = _tensor_dims(tensor, what, source), _tensor_dtype(tensor, what, source)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return limits.unread(dims, dtype, what, source, _HINT), False
    if tensor.HasField("raw_data") and tensor.data_type != onnx.TensorProto.STRING:
        limits.check_fits(what, dims, dtype, len(tensor.raw_data), source, _HINT, bits=_data_bits(tensor))
    try:
        return onnx.numpy_helper.to_array(tensor), True
    except Exception as exc:  # 3 floats for dims [4, 4], a segment, undecodable strings...
        raise limits.misfit(what, dims, dtype, _first_line(exc), source, _HINT) from None


def _tensors(graph, where: str = ""):
    """Every tensor a graph holds, with what to call it: its initializers and each tensor
    attribute of its nodes (as its type says, as the reader takes it), in subgraphs too."""
    kinds = _onnx().AttributeProto
    tensor, tensors, subgraph, subgraphs = kinds.TENSOR, kinds.TENSORS, kinds.GRAPH, kinds.GRAPHS
    for init in graph.initializer:
        yield init, f"initializer {init.name!r}{where}"
    for node in graph.node:
        for attr in node.attribute:
            kind = attr.type
            if kind not in (tensor, tensors, subgraph, subgraphs):
                continue
            name = node.name or (node.output[0] if node.output else "?")
            what = f"attribute {attr.name!r} of node {name!r} ({node.op_type}){where}"
            if kind == tensor:
                yield attr.t, what
            elif kind == tensors:
                for k, t in enumerate(attr.tensors):
                    yield t, f"{what} [{k}]"
            else:
                for sub in [attr.g] if kind == subgraph else attr.graphs:
                    yield from _tensors(sub, f" in a subgraph of node {name!r}")


def _read_small_external_data(model, source: str) -> None:
    """:func:`_read_external` on every tensor of the model (shape inference and folding need
    the small ones; weights stay unread, only their shapes and dtypes are used)."""
    base = str(Path(source).parent) if source != "<model>" else None
    for tensor, what in _tensors(model.graph):
        _read_external(tensor, base, what, source)


def _fix_input_shapes(model, plan: ShardingPlan | None, source: str) -> None:
    """Replace dynamic input dims by the plan's example shapes; refuse those without one."""
    initializers = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in initializers:
            continue
        dims = inp.type.tensor_type.shape.dim
        given = (plan.inputs.get(inp.name, {}) if plan else {}).get("shape")
        if given is not None:
            if len(given) != len(dims):
                raise SpecError("bad-shape", f"the plan gives input {inp.name!r} shape {given}, but the model's input "
                                f"has rank {len(dims)}", path=f"inputs.{inp.name}.shape",
                                hint=f"give {len(dims)} sizes")
            for d, size in zip(dims, given):
                if d.HasField("dim_value") and d.dim_value != size:
                    raise SpecError("bad-shape", f"the plan gives input {inp.name!r} shape {given}, but the model "
                                    f"fixes a dim to {d.dim_value}", path=f"inputs.{inp.name}.shape",
                                    hint="give the model's static sizes")
                d.Clear()
                d.dim_value = size
            continue
        if not inp.type.tensor_type.HasField("shape"):
            raise _bad(f"input {inp.name!r} has no shape", source,
                       f"give its shape in the plan: inputs: {{{inp.name}: {{shape: [...]}}}}")
        dynamic = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
        if dynamic:
            raise SpecError("dynamic-shape", f"input {inp.name!r} has dynamic dims {dynamic} and the plan gives no "
                            "example shape", path=source,
                            hint=f"add inputs: {{{inp.name}: {{shape: [...], placements: [...]}}}} to the plan")


# ----------------------------------------------------------------------------- folding
def _axes_of(node_inputs: list, attrs: dict, consts: list, index: int = 1) -> list[int] | None:
    if len(consts) > index and consts[index] is not None:
        return [int(a) for a in np.asarray(consts[index]).reshape(-1)]
    if "axes" in attrs:
        return [int(a) for a in attrs["axes"]]
    return None


def _slice_np(x, consts, attrs):
    starts, ends = consts[1], consts[2]
    axes = consts[3] if len(consts) > 3 and consts[3] is not None else np.arange(len(starts))
    steps = consts[4] if len(consts) > 4 and consts[4] is not None else np.ones(len(starts), np.int64)
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[int(a)] = slice(int(s), int(e), int(st))
    return x[tuple(index)]


#: the most elements a folded constant may hold (the readers' shared
#: :data:`~layout_prop.frontends.limits.MAX_CONSTANT_ELEMENTS`, 2^24: at most 128 MiB of int64):
#: shapes, indices, small tables and masks up to 4096 x 4096; a node that would fold to more is
#: refused (``too-large``) before anything is allocated
MAX_FOLD_ELEMENTS = limits.MAX_CONSTANT_ELEMENTS

_BROADCASTING = {"Where", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Add", "Sub",
                 "Mul", "Div", "Pow", "Max", "Min"}


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0} - {1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _fold_shape(op: str, c: list, a: dict) -> tuple[int, ...]:
    """The shape folding ``op`` gives, from its inputs' shapes (and shape inputs) alone, nothing
    allocated: ValueError for inputs the op cannot take."""
    def dims(v) -> tuple[int, ...]:
        out = tuple(int(d) for d in np.asarray(v).reshape(-1))
        if any(d < 0 for d in out):
            raise ValueError(f"negative dims {list(out)}")
        return out

    given = [np.asarray(x) for x in c if x is not None]
    if op == "ConstantOfShape":
        return dims(c[0])
    if op == "Expand":
        return _broadcast([given[0].shape, dims(c[1])])
    if op == "Range":
        start, limit, delta = (np.asarray(x).reshape(()).item() for x in c[:3])
        if delta == 0:
            raise ValueError("its delta is 0")
        if all(isinstance(x, int) for x in (start, limit, delta)):
            return (max(-((start - limit) // delta), 0),)
        return (max(math.ceil((limit - start) / delta), 0),)  # inf or nan: OverflowError, ValueError
    if op == "Gather":
        data, index = given
        axis = int(a.get("axis", 0))
        if not -data.ndim <= axis < data.ndim:
            raise ValueError(f"axis {axis} is out of range for rank {data.ndim}")
        axis %= data.ndim
        return data.shape[:axis] + index.shape + data.shape[axis + 1:]
    if op == "GatherND":
        data, index = given
        if index.ndim < 1 or index.shape[-1] > data.ndim:
            raise ValueError(f"indices of shape {list(index.shape)} do not fit data of rank {data.ndim}")
        return index.shape[:-1] + data.shape[index.shape[-1]:]
    if op == "Concat":
        return (sum(x.size for x in given),)  # the count is what matters
    if op in _BROADCASTING:
        return _broadcast([x.shape for x in given])
    return max((x.shape for x in given), key=math.prod, default=())  # never more than an input


def _fold_table() -> dict[str, Callable]:
    onnx = _onnx()

    def cast(c, a):
        return c[0].astype(onnx.helper.tensor_dtype_to_np_dtype(a["to"]))

    def reshape(c, a):
        shape = [int(s) for s in c[1]]
        shape = [c[0].shape[i] if s == 0 and not a.get("allowzero") else s for i, s in enumerate(shape)]
        return c[0].reshape(shape)

    def unsqueeze(c, a):
        axes = _axes_of([], a, c)
        out = c[0]
        rank = out.ndim + len(axes)
        for ax in sorted(x % rank for x in axes):
            out = np.expand_dims(out, ax)
        return out

    def squeeze(c, a):
        axes = _axes_of([], a, c)
        return np.squeeze(c[0], axis=tuple(axes)) if axes else np.squeeze(c[0])

    def trilu(c, a):
        k = int(c[1]) if len(c) > 1 and c[1] is not None else 0
        return np.triu(c[0], k) if a.get("upper", 1) else np.tril(c[0], k)

    def const_of_shape(c, a):
        value = a["value"] if "value" in a else np.zeros(1, np.float32)  # a tensor attr: read by attrs()
        if value.size != 1:
            raise ValueError(f"its value has {value.size} elements, not one")
        return np.full([int(s) for s in c[0]], value.reshape(-1)[0], dtype=value.dtype)

    def div(c, a):
        if np.issubdtype(c[0].dtype, np.integer):
            if np.any(np.asarray(c[1]) == 0):
                raise ValueError("an integer division by zero")
            return c[0] // c[1]
        return c[0] / c[1]

    def gather(c, a):
        return np.take(c[0], c[1], axis=a.get("axis", 0))

    def cast_like(c, a):
        return c[0].astype(c[1].dtype)

    def cumsum(c, a):
        axis = int(np.asarray(c[1]).reshape(()))
        x = np.flip(c[0], axis) if a.get("reverse", 0) else c[0]
        out = np.cumsum(x, axis=axis, dtype=c[0].dtype)
        if a.get("exclusive", 0):
            out = np.concatenate([np.zeros_like(np.take(out, [0], axis=axis)), np.delete(out, -1, axis=axis)], axis)
        return np.flip(out, axis) if a.get("reverse", 0) else out

    def gather_nd(c, a):
        data, index = c[0], np.asarray(c[1])
        batch = int(a.get("batch_dims", 0))
        if batch:
            raise ValueError("batch_dims is not folded")
        return data[tuple(np.moveaxis(index, -1, 0))]

    def gather_elements(c, a):
        return np.take_along_axis(c[0], c[1], axis=int(a.get("axis", 0)))

    return {
        "Identity": lambda c, a: c[0],
        "Cast": cast,
        "Reshape": reshape,
        "Unsqueeze": unsqueeze,
        "Squeeze": squeeze,
        "Concat": lambda c, a: np.concatenate(c, axis=a["axis"]),
        "Gather": gather,
        "GatherElements": gather_elements,
        "GatherND": gather_nd,
        "CastLike": cast_like,
        "CumSum": cumsum,
        "Cos": lambda c, a: np.cos(c[0]),
        "Sin": lambda c, a: np.sin(c[0]),
        "Exp": lambda c, a: np.exp(c[0]),
        "IsNaN": lambda c, a: np.isnan(c[0]),
        "Abs": lambda c, a: np.abs(c[0]),
        "Log": lambda c, a: np.log(c[0]),  # T5's relative-position buckets
        "Floor": lambda c, a: np.floor(c[0]),
        "Ceil": lambda c, a: np.ceil(c[0]),
        "Sign": lambda c, a: np.sign(c[0]),
        "Xor": lambda c, a: np.logical_xor(c[0], c[1]),
        "ReduceSum": lambda c, a: np.sum(c[0], axis=None if len(c) < 2 or c[1] is None else tuple(int(x) for x in c[1]),
                                         keepdims=bool(a.get("keepdims", 1))),
        "Slice": lambda c, a: _slice_np(c[0], c, a),
        "Range": lambda c, a: np.arange(c[0], c[1], c[2]).astype(c[0].dtype),
        "Expand": lambda c, a: c[0] * np.ones([int(s) for s in c[1]], dtype=c[0].dtype),
        "Where": lambda c, a: np.where(c[0], c[1], c[2]),
        "Equal": lambda c, a: np.equal(c[0], c[1]),
        "Less": lambda c, a: np.less(c[0], c[1]),
        "LessOrEqual": lambda c, a: np.less_equal(c[0], c[1]),
        "Greater": lambda c, a: np.greater(c[0], c[1]),
        "GreaterOrEqual": lambda c, a: np.greater_equal(c[0], c[1]),
        "Not": lambda c, a: np.logical_not(c[0]),
        "And": lambda c, a: np.logical_and(c[0], c[1]),
        "Or": lambda c, a: np.logical_or(c[0], c[1]),
        "Trilu": trilu,
        "ConstantOfShape": const_of_shape,
        "Add": lambda c, a: c[0] + c[1],
        "Sub": lambda c, a: c[0] - c[1],
        "Mul": lambda c, a: c[0] * c[1],
        "Div": div,
        "Neg": lambda c, a: -c[0],
        "Sqrt": lambda c, a: np.sqrt(c[0]),
        "Pow": lambda c, a: np.power(c[0], c[1]),
        "Transpose": lambda c, a: np.transpose(c[0], a.get("perm")),
        "Max": lambda c, a: functools.reduce(np.maximum, c),  # broadcasting (maximum.reduce stacks them)
        "Min": lambda c, a: functools.reduce(np.minimum, c),
        "ReduceProd": lambda c, a: np.prod(c[0], keepdims=bool(a.get("keepdims", 1))),
    }


def _node_attrs(node, name: str, source: str) -> dict:
    """A node's attributes as Python values; a tensor attribute as its numpy value
    (:func:`_tensor_array`: the same rule as initializers)."""
    onnx = _onnx()
    out = {}
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR:
            out[attr.name] = _tensor_array(attr.t, f"attribute {attr.name!r} of node {name!r} ({node.op_type})",
                                           source)[0]
        else:
            out[attr.name] = onnx.helper.get_attribute_value(attr)
    return out


#: the node metadata torch's dynamo exporter writes: the FX node a node comes from (its
#: arguments name the module's parameters, ``%p_model_layers_0_self_attn_q_proj_weight``) and
#: the module path of every scope it lies in (``['', 'model', 'model.layers.0', ...]``)
TORCH_FX_NODE = "pkg.torch.onnx.fx_node"
TORCH_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_FX_PARAMETER = re.compile(r"%(p_[A-Za-z0-9_]+)")


def _module_path(node) -> str:
    """The torch module a node of the dynamo exporter comes from (``model.layers.0.self_attn.o_proj``): the
    deepest of its ``name_scopes`` but the last (the FX node's own name); ``""`` without that metadata."""
    for prop in node.metadata_props:
        if prop.key == TORCH_NAME_SCOPES:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return ""
            return str(scopes[-2]) if isinstance(scopes, list) and len(scopes) >= 2 else ""
    return ""


def _torch_name(fx_name: str, scopes: list[str]) -> str:
    """The parameter's name in torch (``model.layers.0.self_attn.q_proj.weight``) from its FX name
    (``p_model_layers_0_self_attn_q_proj_weight``) and the module scopes of the node reading it:
    the deepest module whose path, dots as underscores, begins the FX name owns it."""
    flat = fx_name[2:]
    for module in sorted((m for m in scopes if m), key=len, reverse=True):
        prefix = module.replace(".", "_") + "_"  # FX lowercases names: embeddings.LayerNorm -> embeddings_layernorm
        if flat.lower().startswith(prefix.lower()) and len(flat) > len(prefix):
            return f"{module}.{flat[len(prefix):]}"
    return flat


def _pair_parameters(inits: list[str], names: list[str], ranks: dict[str, int]) -> list[tuple[str, str]]:
    """Which of a node's initializer inputs ``inits`` is which of its FX parameters ``names``: by name
    when an initializer keeps torch's, else in order when they are as many, else by kind (a 1-D initializer is the
    ``*.bias``, another the ``*.weight``: ``aten.linear(x, %p_w, %p_b)`` exported as a MatMul of a
    folded ``val_N`` weight, or an Add of the bias)."""
    pairs = [(v, v) for v in inits if v in names]
    if pairs:
        return pairs
    if len(inits) == len(names):  # in order: LayerNormalization(x, scale, B) of aten.layer_norm(x, s, %p_w, %p_b)
        return list(zip(inits, names))
    out = []
    for v in inits:
        suffix = ".bias" if ranks.get(v) == 1 else ".weight"
        fitting = [n for n in names if n.endswith(suffix)]
        if len(fitting) == 1:
            out.append((v, fitting[0]))
    return out


def _torch_parameters(graph, weights: set[str]) -> tuple[dict[str, list[str]], set[str]] | None:
    """What torch's node metadata says of the model's float initializers ``weights``: each one's
    torch parameter names (in graph order; several when the exporter de-duplicated equal
    tensors) and the set of those read by a node that carries metadata.  None for a model
    without torch's metadata (another exporter, or TorchScript's).

    A node's FX arguments that are parameters (``%p_...``) are matched with its initializer
    inputs: by name when an initializer keeps torch's name (``optimize=False``), else one to one
    when the node reads exactly one parameter and one weight (a folded transposed Linear weight
    ``val_113`` read by the ``MatMul`` of ``aten.linear(x, %p_..._weight)``)."""
    names: dict[str, list[str]] = {}
    read: set[str] = set()
    ranks = {t.name: len(t.dims) for t in graph.initializer}
    found = False
    for node in graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        if TORCH_FX_NODE not in meta:
            continue
        found = True
        inits = [v for v in node.input if v in weights]
        read.update(inits)
        params = list(dict.fromkeys(_FX_PARAMETER.findall(meta[TORCH_FX_NODE])))
        if not inits or not params:
            continue
        try:
            scopes = [str(m) for m in ast.literal_eval(meta.get(TORCH_NAME_SCOPES, "[]"))]
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            scopes = []
        by_flat = {v.replace(".", "_").lower(): v for v in inits}  # an initializer keeping torch's name
        torch_names = [by_flat.get(p[2:].lower()) or _torch_name(p, scopes) for p in params]
        for init, name in _pair_parameters(inits, torch_names, ranks):
            if name not in names.setdefault(init, []):
                names[init].append(name)
    return (names, read) if found else None


# ----------------------------------------------------------------------------- conversion
class _Reader:
    """Turns one ONNX graph into a ModelGraph."""

    def __init__(self, model, source: str, computed: frozenset[str] = frozenset(), torch_meta=None) -> None:
        self.onnx = _onnx()
        self.torch_meta = torch_meta  # what _torch_parameters found (None: no torch metadata)
        self.computed = computed  # float initializers computed from no parameter: folded like constants
        self.model = model
        self.source = source
        self.g = ModelGraph("onnx")
        self.fold = _fold_table()
        self.count = 0
        self.defined: dict[str, Any] = {}  # ONNX value name -> what defines it (each value is defined once)
        self.unread: set[str] = set()  # constants whose data stays in an external file: never folded
        self.keep_modules = False  # record each value's torch module path (ModelGraph.modules)

    # values ---------------------------------------------------------------
    def value_info(self, info, what: str) -> None:
        t = info.type.tensor_type
        if not t.HasField("shape"):
            raise _bad(f"{what} {info.name!r} has no inferred shape", self.source,
                       "give the model static shapes (or example shapes in the plan)")
        dims = []
        for d in t.shape.dim:
            if not d.HasField("dim_value"):
                raise self._dynamic(info.name, what, d.dim_param or "?")
            dims.append(int(d.dim_value))
        self.g.add_value(Value(info.name, tuple(dims), _dtype(t.elem_type, f"{what} {info.name!r}", self.source)))

    def _dynamic(self, value: str, what: str, dim: str) -> SpecError:
        """``dynamic-shape`` for a value whose dim shape inference left unknown, with the hint that
        fits: example input shapes when an input has dynamic dims, else the node that computes
        the shape from run-time values (the importer folded every constant chain it could)."""
        message = f"{what} {value!r} has a dynamic dim {dim} after shape inference"
        graph = self.model.graph
        initializers = {t.name for t in graph.initializer}
        inputs = [i for i in graph.input if i.name not in initializers]
        if any(_static_shape(i) is None for i in inputs):
            return SpecError("dynamic-shape", message, path=self.source,
                             hint="give example shapes of every input in the plan (inputs.NAME.shape)")
        producer = next((n for n in graph.node if value in n.output), None)
        where = f"node {producer.name or producer.output[0]!r} ({producer.op_type})" if producer else "a node"
        return SpecError("dynamic-shape", f"{message}: every input's shape is static, but {where} computes it from "
                         "values only known at run time (the importer folds constant chains, not data)",
                         path=self.source, hint="export the model with static shapes (torch.onnx.export(..., "
                         "dynamo=True) without dynamic_shapes), or simplify it with onnxsim first")

    def const_value(self, name: str, array: np.ndarray, weight: bool = False, read: bool = True) -> None:
        array = np.asarray(array)
        dtype = str(array.dtype)
        if array.dtype.kind in "OSUc":  # strings (onnx gives them as objects), complex numbers
            raise SpecError("unsupported-dtype", f"constant {name!r} has dtype "
                            f"{'complex' if array.dtype.kind == 'c' else 'string'}", path=self.source,
                            hint="the importer reads numeric and boolean tensors only")
        if dtype not in ("float16", "bfloat16", "float32", "float64", "int32", "int64", "bool"):
            dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
            # an unread tensor stays an array of zeros that takes no memory (of the new dtype: bounded again)
            array = array.astype(dtype) if read else \
                limits.unread(array.shape, dtype, f"constant {name!r}", self.source, _HINT)
        if not read:
            self.unread.add(name)
        self.g.add_value(Value(name, tuple(array.shape), dtype, const=array, weight=weight))

    def attrs(self, node, name: str) -> dict:
        """A node's attributes (:func:`_node_attrs`)."""
        return _node_attrs(node, name, self.source)

    def new_value(self, base: str, shape, dtype: str) -> str:
        name = self.g.fresh(base)
        self.g.add_value(Value(name, tuple(shape), dtype))
        return name

    def add(self, op: str, inputs: list[str], outputs: list[str], attrs: dict | None = None, source: str = "",
            name: str = "") -> None:
        self.g.nodes.append(MNode(name or outputs[0], op, list(inputs), list(outputs), dict(attrs or {}), source))

    # the graph ------------------------------------------------------------
    def read(self) -> ModelGraph:
        graph = self.model.graph
        names = [t.name for t in graph.initializer] + [v.name for v in graph.input] + [v.name for v in graph.output]
        for node in graph.node:
            names += [node.name, node.op_type, node.domain, *node.input, *node.output]
        if not all(isinstance(n, str) for n in names):  # proto2 hands out invalid UTF-8 as bytes
            raise _bad(f"{self.source!r} holds names that are not UTF-8 text (a damaged file)", self.source)
        hint = "an ONNX graph defines each value once; re-export the model"
        for init in graph.initializer:
            if init.name in self.defined:
                raise _bad(f"initializer {init.name!r} is defined twice", self.source, hint)
            self.defined[init.name] = "an initializer"
            array, read = _tensor_array(init, f"initializer {init.name!r}", self.source)  # weights: not read
            self.const_value(init.name, array, weight=True, read=read)
        initializers = {t.name for t in graph.initializer}
        self.torch_names()
        listed: set[str] = set()
        for inp in graph.input:
            if inp.name in listed:
                raise _bad(f"graph input {inp.name!r} is listed twice", self.source, hint)
            listed.add(inp.name)
            self.defined.setdefault(inp.name, "a graph input")  # an input may give an initializer's default
            if inp.name not in initializers:
                self.value_info(inp, "input")
                self.g.inputs.append(inp.name)
        for info in list(graph.value_info) + list(graph.output):
            if info.name not in self.g.values:
                self.value_info(info, "value")
        if self.keep_modules:
            for node in graph.node:
                first = len(self.g.nodes)
                self.node(node)
                module = _module_path(node)
                if module:
                    self.g.modules.update((v, module) for n in self.g.nodes[first:] for v in n.outputs)
        else:
            for node in graph.node:
                self.node(node)
        self.g.outputs = [o.name for o in graph.output]
        return self.g

    def torch_names(self) -> None:
        """Name the weights as torch does, from the dynamo exporter's node metadata
        (:func:`_torch_parameters`): a weight named by the exporter (``val_113``) takes its
        parameter's torch name, a de-duplicated tensor the first of its names and the others as
        aliases; a float weight that nodes with metadata read but that no parameter names (a
        rotary cos/sin table or a mask the exporter computed and folded) is a constant."""
        if self.torch_meta is None:
            return
        names, read = self.torch_meta
        taken = set(self.g.values)
        for init, torch_names in names.items():
            primary = init if init in torch_names else next((n for n in torch_names if n not in taken), None)
            if primary is None:  # a copy of a parameter another initializer holds (a tied, transposed weight)
                primary = self.copy_name(init, torch_names[0], taken)
            if primary != init:
                self.g.param_names[init] = primary
                taken.add(primary)
            others = [n for n in torch_names if n != primary and n not in taken]
            if others:
                self.g.aliases[init] = others
        self.g.constants.update(v for v in read if v not in names)

    def copy_name(self, init: str, name: str, taken: set[str]) -> str:
        """The name of initializer ``init``, a second copy of parameter ``name`` (whose own
        initializer holds the name): ``NAME.T`` when it is the transpose of it, else ``NAME.copy``;
        noted, since the two take gradients of their own."""
        shape, theirs = self.g.shape(init), self.g.shape(name)
        base = f"{name}.T" if shape is not None and theirs is not None and tuple(shape) == tuple(theirs)[::-1] and \
            len(shape) == 2 else f"{name}.copy"
        new, k = base, 1
        while new in taken:
            new, k = f"{base}{k}", k + 1
        how = "transposed" if base.endswith(".T") else "as is"
        self.g.notes.append(f"initializer {init} is a copy of parameter {name} ({how}) the exporter stored apart "
                            f"(a tied weight): named {new}; the two take gradients of their own")
        return new

    def node(self, node) -> None:
        op = node.op_type
        ins = list(node.input)
        outs = list(node.output)
        name = node.name or (outs[0] if outs else op)
        defined = self.defined
        for v in ins:
            if v and v not in defined:
                raise _bad(f"node {name!r} ({op}) reads {v!r}, which no graph input, initializer or earlier node "
                           "defines", self.source, "an ONNX graph defines each value before its use; re-export the "
                           "model")
        for out in outs:
            if out:
                if out in defined:
                    first = defined[out]
                    first = first if isinstance(first, str) else \
                        f"node {first.name or first.output[0]!r} ({first.op_type})"
                    raise _bad(f"node {name!r} ({op}) writes {out!r}, which {first} already defines",
                               self.source, "an ONNX graph defines each value once; re-export the model")
                defined[out] = node
        if op == "Constant" and node.domain in ("", "ai.onnx"):
            return self.constant(node, name, outs)
        a = self.attrs(node, name)
        if node.domain not in ("", "ai.onnx", "com.microsoft"):
            return self.unknown(node, ins, outs, a)
        consts = [self.g.const(v) if v and v not in self.unread else None for v in ins]
        if op == "Shape" and self.g.shape(ins[0]) is not None:
            shape = np.array(self.g.shape(ins[0]), np.int64)
            start, end = a.get("start", 0), a.get("end", None)
            self.const_value(outs[0], shape[start:end])
            return
        weights_in = any(v and v not in self.computed and self.g.values[v].weight and
                         self.g.values[v].dtype.startswith("float")
                         and self.g.values[v].const.size > 1 for v in ins)
        if op in self.fold and all(c is not None for v, c in zip(ins, consts) if v) and not weights_in:
            args = [c if v else None for v, c in zip(ins, consts)]
            try:
                shape = _fold_shape(op, args, a)
                if math.prod(shape) <= MAX_FOLD_ELEMENTS:
                    with np.errstate(all="ignore"):  # inf and nan are values; no warning line on stderr
                        result = self.fold[op](args, a)
            except Exception as exc:
                why = _first_line(exc)
                raise _bad(f"cannot evaluate constant node {name!r} ({op}): {why}", self.source) from None
            if math.prod(shape) > MAX_FOLD_ELEMENTS:
                raise _too_large(name, op, shape, self.source)
            self.const_value(outs[0], result)
            return
        for out in outs:
            if out and out not in self.g.values:
                raise _bad(f"node {name!r} ({op}) output {out!r} has no inferred shape", self.source,
                           "give example shapes of every input in the plan (inputs.NAME.shape)")
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            return self.unknown(node, ins, outs, a)
        try:
            handler(name, ins, outs, a, consts)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # a constant of the wrong kind
            raise _bad(f"cannot read node {name!r} ({op}): its inputs or attributes are not what {op} takes "
                       f"({type(exc).__name__}: {exc})", self.source) from None

    def constant(self, node, name: str, outs: list[str]) -> None:
        what = f"node {name!r} (Constant)"
        if len(node.attribute) != 1 or len(outs) != 1:
            raise _bad(f"{what} has {len(node.attribute)} attributes and {len(outs)} outputs (one of each)",
                       self.source)
        attr = node.attribute[0]
        if attr.name == "value" and attr.type == self.onnx.AttributeProto.TENSOR:
            array, read = _tensor_array(attr.t, f"the value of {what}", self.source)
            return self.const_value(outs[0], array, read=read)
        if attr.name == "sparse_value":
            raise SpecError("unknown-op", f"{what} holds a sparse_value, which the importer does not read",
                            path=self.source, hint="store the constant dense (value=...)")
        if attr.name in ("value_string", "value_strings"):
            raise SpecError("unsupported-dtype", f"{what} holds strings ({attr.name})", path=self.source,
                            hint="the importer reads numeric and boolean tensors only")
        if attr.name not in ("value_float", "value_floats", "value_int", "value_ints"):
            raise _bad(f"{what} has attribute {attr.name!r}, which Constant does not take", self.source)
        self.const_value(outs[0], np.asarray(self.onnx.helper.get_attribute_value(attr)))

    def unknown(self, node, ins, outs, a) -> None:
        self.add(f"unmapped:{node.op_type}", [v for v in ins if v], [o for o in outs if o], {}, node.op_type,
                 node.name or outs[0])

    # one method per ONNX op --------------------------------------------------
    def _simple(op: str, source: str):  # noqa: N805 - a method factory
        def handler(self, name, ins, outs, a, consts):
            self.add(op, ins, outs, {}, source, name)
        return handler

    op_Add = _simple("add", "Add")
    op_Sub = _simple("sub", "Sub")
    op_Mul = _simple("mul", "Mul")
    op_Div = _simple("div", "Div")
    op_Pow = _simple("pow", "Pow")
    op_Sqrt = _simple("sqrt", "Sqrt")
    op_Reciprocal = _simple("reciprocal", "Reciprocal")
    op_Neg = _simple("neg", "Neg")
    op_Exp = _simple("exp", "Exp")
    op_Erf = _simple("erf", "Erf")
    op_Tanh = _simple("tanh", "Tanh")
    op_Sigmoid = _simple("sigmoid", "Sigmoid")
    op_Relu = _simple("relu", "Relu")
    op_Identity = _simple("identity", "Identity")
    op_Where = _simple("where", "Where")
    op_Expand = _simple("expand", "Expand")
    op_IsNaN = _simple("isnan", "IsNaN")
    op_Cos = _simple("cos", "Cos")
    op_Sin = _simple("sin", "Sin")

    def op_MatMul(self, name, ins, outs, a, consts):
        """numpy's matmul: a 1-D operand is a row on the left, a column on the right, and that
        dim is dropped from the result; ``matmul_nd`` takes 2-D and up, so the vector is
        unsqueezed and the product squeezed."""
        x, w = ins[0], ins[1]
        x_shape, w_shape = tuple(self.g.shape(x)), tuple(self.g.shape(w))
        if len(x_shape) >= 2 and len(w_shape) >= 2:
            return self.add("matmul_nd", [x, w], outs, {}, "MatMul", name)
        out, dropped = outs[0], []
        batch = tuple(np.broadcast_shapes(x_shape[:-2], w_shape[:-2]))
        if len(x_shape) == 1:
            x_shape = (1,) + x_shape
            x = self._unsqueeze(x, x_shape, 0, f"{name}_row")
            dropped.append(len(batch))  # the row's dim of the product
        if len(w_shape) == 1:
            w_shape = w_shape + (1,)
            w = self._unsqueeze(w, w_shape, 1, f"{name}_column")
            dropped.append(len(batch) + 1)  # the column's
        product = self.new_value(f"{out}_mm", batch + (x_shape[-2], w_shape[-1]), self.g.values[out].dtype)
        self.add("matmul_nd", [x, w], [product], {}, "MatMul", name)
        self.add("squeeze", [product], [out], {"dims": dropped}, "MatMul", f"{name}_drop")

    def _unsqueeze(self, value: str, shape: tuple[int, ...], dim: int, name: str) -> str:
        new = self.new_value(f"{value}_{dim}", shape, self.g.values[value].dtype)
        self.add("unsqueeze", [value], [new], {"dims": [dim]}, "MatMul", name)
        return new

    def op_Gelu(self, name, ins, outs, a, consts):
        self.add("gelu" if a.get("approximate", b"none") in (b"tanh", "tanh") else "gelu_erf", ins, outs, {},
                 "Gelu", name)

    def op_Softmax(self, name, ins, outs, a, consts):
        self.add("softmax", ins, outs, {"axis": a.get("axis", -1)}, "Softmax", name)

    def op_LogSoftmax(self, name, ins, outs, a, consts):
        self.add("log_softmax", ins, outs, {"axis": a.get("axis", -1)}, "LogSoftmax", name)

    def op_Cast(self, name, ins, outs, a, consts):
        self.add("cast", ins, outs, {"dtype": self.g.values[outs[0]].dtype}, "Cast", name)

    def op_Dropout(self, name, ins, outs, a, consts):
        """Inference dropout (no ``training_mode``, or a constant false one) is the identity; training
        dropout of a constant ratio is ``dropout(x; p)`` (the registry's counter-based draws: a valid
        mask, not onnxruntime's); a used mask output or a run-time ratio or mode is left unmapped."""
        ratio = consts[1] if len(ins) > 1 and ins[1] else np.float32(0.5)
        mode = consts[2] if len(ins) > 2 and ins[2] else np.bool_(False)
        if any(outs[1:]) or ratio is None or mode is None:
            return self.add("unmapped:Dropout", [v for v in ins if v], [o for o in outs if o], {}, "Dropout", name)
        if not bool(np.asarray(mode).reshape(-1)[0]):
            return self.add("identity", ins[:1], outs[:1], {}, "Dropout", name)
        self.add("dropout", ins[:1], outs[:1], {"p": scalar_value(ratio), "seed": 0, "training": True}, "Dropout", name)
        self.g.notes.append(f"node {name} (Dropout) is training dropout (p={scalar_value(ratio)}): its draws are "
                            "layout-prop's counter-based ones, so outputs differ from onnxruntime's")

    def op_CastLike(self, name, ins, outs, a, consts):
        """A cast to the dtype of the second input (torch's dynamo exporter writes it before scalar
        arithmetic): a constant cast like a computed value is folded (only the dtype is read)."""
        dtype = self.g.values[outs[0]].dtype
        if consts[0] is not None:
            return self.const_value(outs[0], consts[0].astype(dtype))
        self.add("cast", ins[:1], outs, {"dtype": dtype}, "CastLike", name)

    def op_Gemm(self, name, ins, outs, a, consts):
        x, w = ins[0], ins[1]
        bias = ins[2] if len(ins) > 2 and ins[2] else None
        if a.get("transB", 0) and not a.get("transA", 0) and a.get("alpha", 1.0) == 1.0 and \
                a.get("beta", 1.0) == 1.0 and (bias is None or len(self.g.shape(bias)) == 1):
            return self.add("linear", [x, w] + ([bias] if bias else []), outs, {}, "Gemm", name)  # torch's Linear
        if a.get("transA", 0):
            x = self._transpose(x, [1, 0], name)
        out = outs[0]
        shape, dtype = self.g.shape(out), self.g.values[out].dtype
        prod = out if len(ins) < 3 and a.get("alpha", 1.0) == 1.0 else self.new_value(f"{out}_mm", shape, dtype)
        self.add("matmul_nd", [x, w], [prod], {"transpose_b": bool(a.get("transB", 0))}, "Gemm", name)
        if a.get("alpha", 1.0) != 1.0:
            scaled = out if len(ins) < 3 else self.new_value(f"{out}_alpha", shape, dtype)
            self.add("scale", [prod], [scaled], {"factor": float(a["alpha"])}, "Gemm", f"{name}_alpha")
            prod = scaled
        if len(ins) >= 3 and ins[2]:
            c = ins[2]
            if a.get("beta", 1.0) != 1.0:
                c2 = self.new_value(f"{out}_beta", self.g.shape(c), dtype)
                self.add("scale", [c], [c2], {"factor": float(a["beta"])}, "Gemm", f"{name}_beta")
                c = c2
            self.add("add", [prod, c], [out], {}, "Gemm", f"{name}_bias")

    def _transpose(self, x: str, perm: list[int], name: str) -> str:
        shape = self.g.shape(x)
        out = self.new_value(f"{x}_t", [shape[p] for p in perm], self.g.values[x].dtype)
        self.add("transpose", [x], [out], {"dims": perm}, "Transpose", f"{name}_transpose")
        return out

    def op_Transpose(self, name, ins, outs, a, consts):
        rank = len(self.g.shape(ins[0]))
        perm = list(a.get("perm", range(rank - 1, -1, -1)))
        self.add("transpose", ins[:1], outs, {"dims": [int(p) for p in perm]}, "Transpose", name)

    def op_Reshape(self, name, ins, outs, a, consts):
        self.add("reshape", ins[:1], outs, {"shape": list(self.g.shape(outs[0]))}, "Reshape", name)

    def op_Flatten(self, name, ins, outs, a, consts):
        self.add("reshape", ins[:1], outs, {"shape": list(self.g.shape(outs[0]))}, "Flatten", name)

    def op_Concat(self, name, ins, outs, a, consts):
        self.add("concat", ins, outs, {"axis": int(a["axis"])}, "Concat", name)

    def op_Split(self, name, ins, outs, a, consts):
        axis = int(a.get("axis", 0))
        sizes = [self.g.shape(o)[axis] for o in outs]
        self.add("split", ins[:1], outs, {"axis": axis, "sizes": sizes}, "Split", name)

    def op_Slice(self, name, ins, outs, a, consts):
        if any(v and consts[i] is None for i, v in enumerate(ins) if i > 0):
            return self.add("unmapped:Slice", [ins[0]], outs, {}, "Slice", name)
        shape = self.g.shape(ins[0])
        starts, ends = consts[1].reshape(-1), consts[2].reshape(-1)
        axes = consts[3].reshape(-1) if len(ins) > 3 and ins[3] else np.arange(len(starts))
        steps = consts[4].reshape(-1) if len(ins) > 4 and ins[4] else np.ones(len(starts), np.int64)
        src = ins[0]
        cur = list(shape)
        pieces = list(zip(starts, ends, axes, steps))
        for k, (s, e, ax, st) in enumerate(pieces):
            ax = int(ax) % len(shape)
            lo, hi, step = slice(int(s), int(e), int(st)).indices(shape[ax])
            last = k == len(pieces) - 1
            cur[ax] = len(range(lo, hi, step))
            dst = outs[0] if last else self.new_value(f"{outs[0]}_{k}", cur, self.g.values[src].dtype)
            if step == 1:
                self.add("slice", [src], [dst], {"axis": ax, "start": lo, "stop": hi}, "Slice", f"{name}_{k}")
            else:
                self.add("slice_step", [src], [dst], {"axis": ax, "start": lo, "stop": hi, "step": step}, "Slice",
                         f"{name}_{k}")
            src = dst

    def op_Unsqueeze(self, name, ins, outs, a, consts):
        axes = _axes_of(ins, a, consts)
        rank = len(self.g.shape(outs[0]))
        self.add("unsqueeze", ins[:1], outs, {"dims": [int(x) % rank for x in axes]}, "Unsqueeze", name)

    def op_Squeeze(self, name, ins, outs, a, consts):
        axes = _axes_of(ins, a, consts)
        shape = self.g.shape(ins[0])
        if axes is None:
            axes = [i for i, s in enumerate(shape) if s == 1]
        self.add("squeeze", ins[:1], outs, {"dims": [int(x) % len(shape) for x in axes]}, "Squeeze", name)

    def _reduce(self, op: str, source: str, name, ins, outs, a, consts):
        axes = _axes_of(ins, a, consts)
        if axes is None and a.get("noop_with_empty_axes", 0):
            return self.add("identity", ins[:1], outs, {}, source, name)
        rank = len(self.g.shape(ins[0]))
        dims = None if axes is None else [int(x) % rank for x in axes]
        self.add(op, ins[:1], outs, {"dims": dims, "keepdim": bool(a.get("keepdims", 1))}, source, name)

    def op_ReduceMean(self, *args):
        self._reduce("mean", "ReduceMean", *args)

    def op_ReduceSum(self, *args):
        self._reduce("sum", "ReduceSum", *args)

    def op_ReduceMax(self, *args):
        self._reduce("max", "ReduceMax", *args)

    def op_LayerNormalization(self, name, ins, outs, a, consts):
        rank = len(self.g.shape(ins[0]))
        axis = int(a.get("axis", -1)) % rank
        args = list(ins[:3])
        if len(args) < 3 or not args[2]:
            zeros = self.g.fresh(f"{name}_zero_bias")
            self.const_value(zeros, np.zeros(self.g.shape(ins[1]), dtype=self.g.values[ins[1]].dtype))
            args = [ins[0], ins[1], zeros]
        self.add("layer_norm", args, outs[:1], {"eps": float(a.get("epsilon", 1e-5)), "normalized_ndim": rank - axis},
                 "LayerNormalization", name)

    def op_RMSNormalization(self, name, ins, outs, a, consts):
        rank = len(self.g.shape(ins[0]))
        axis = int(a.get("axis", -1)) % rank
        self.add("rms_norm", ins[:2], outs[:1], {"eps": float(a.get("epsilon", 1e-5)), "normalized_ndim": rank - axis},
                 "RMSNormalization", name)

    def op_Gather(self, name, ins, outs, a, consts):
        data, idx = ins
        value = self.g.values[data]
        rank, axis = len(value.shape), int(a.get("axis", 0))
        if not -rank <= axis < rank:
            raise _bad(f"node {name!r} (Gather) has axis {axis}, out of range for {data!r} of rank {rank}",
                       self.source, f"ONNX Gather's axis lies in [-{rank}, {rank - 1}]")
        if consts[1] is not None and consts[1].size:  # ONNX: indices lie in [-s, s-1]; numpy would wrap them
            size = value.shape[axis]
            low, high = int(consts[1].min()), int(consts[1].max())
            if low < -size or high >= size:
                bad = low if low < -size else high
                raise _bad(f"node {name!r} (Gather) has index {bad}, out of range for dim {axis % rank} of {data!r} "
                           f"(size {size})", self.source,
                           f"ONNX Gather's indices lie in [-{size}, {size - 1}]" if size else
                           "a dim of size 0 has no index")
        if int(a.get("axis", 0)) == 0 and value.weight and len(value.shape) == 2 and \
                (consts[1] is None or consts[1].size > 1):  # ids known here too: BERT's token types, positions
            return self.add("embedding", [idx, data], outs, {}, "Gather", name)
        if consts[1] is not None and consts[1].size == 1:  # x[..., i, ...]: a slice, then a squeeze
            axis = axis % rank
            i = int(consts[1].reshape(())) % value.shape[axis]
            cut = list(value.shape)
            cut[axis] = 1
            mid = self.new_value(f"{outs[0]}_slice", cut, value.dtype)
            self.add("slice", [data], [mid], {"axis": axis, "start": i, "stop": i + 1}, "Gather", f"{name}_slice")
            if consts[1].ndim == 0:
                return self.add("squeeze", [mid], outs, {"dims": [axis]}, "Gather", name)
            return self.add("identity", [mid], outs, {}, "Gather", name)
        self.add("take", ins, outs, {"axis": int(a.get("axis", 0))}, "Gather", name)  # numpy's take, not torch.gather

    def op_GatherElements(self, name, ins, outs, a, consts):
        """torch.gather: ``gather(x, index; dim)`` (an index known here is taken into [0, s))."""
        data, idx = ins
        rank = len(self.g.shape(data))
        axis = int(a.get("axis", 0))
        if not -rank <= axis < rank:
            raise _bad(f"node {name!r} (GatherElements) has axis {axis}, out of range for {data!r} of rank {rank}",
                       self.source, f"ONNX GatherElements' axis lies in [-{rank}, {rank - 1}]")
        axis %= rank
        if consts[1] is not None and consts[1].size:
            size = self.g.shape(data)[axis]
            if int(consts[1].min()) < -size or int(consts[1].max()) >= size:
                raise _bad(f"node {name!r} (GatherElements) has an index out of range for dim {axis} of {data!r} "
                           f"(size {size})", self.source, f"ONNX GatherElements' indices lie in [-{size}, {size - 1}]")
            if int(consts[1].min()) < 0:
                idx = self.g.fresh(f"{idx}_wrapped")
                self.const_value(idx, np.where(consts[1] < 0, consts[1] + size, consts[1]))
        else:
            self.g.notes.append(f"node {name} (GatherElements) is torch.gather: its run-time indices must lie in "
                                f"[0, {self.g.shape(data)[axis]}) (ONNX also allows negative ones)")
        self.add("gather", [data, idx], outs, {"dim": axis}, "GatherElements", name)

    def _constant_index(self, op: str, name: str, data: str, idx: str, axis: int, index: np.ndarray | None) -> str:
        """An index input of ``GatherElements``/``ScatterElements`` along ``axis`` of ``data``: a constant one
        out of ``[-s, s)`` is ``bad-model``, a negative one taken into ``[0, s)`` (a new constant); a run-time
        one is noted (torch's ops take ``[0, s)``, ONNX also negative indices).  Returns the index to read."""
        size = self.g.shape(data)[axis]
        if index is None:
            self.g.notes.append(f"node {name} ({op}) is torch's: its run-time indices must lie in [0, {size}) "
                                "(ONNX also allows negative ones)")
            return idx
        if not index.size:
            return idx
        low, high = int(index.min()), int(index.max())
        if low < -size or high >= size:
            raise _bad(f"node {name!r} ({op}) has index {low if low < -size else high}, out of range for dim {axis} "
                       f"of {data!r} (size {size})", self.source,
                       f"ONNX {op}' indices lie in [-{size}, {size - 1}]" if size else "a dim of size 0 has no index")
        if low >= 0:
            return idx
        wrapped = self.g.fresh(f"{idx}_wrapped")
        self.const_value(wrapped, np.where(index < 0, index + size, index))
        return wrapped

    def _axis(self, op: str, name: str, value: str, axis: int) -> int:
        """``axis`` of ``value`` in ``[0, rank)``; ``bad-model`` out of ``[-rank, rank)``."""
        rank = len(self.g.shape(value))
        if not -rank <= axis < rank:
            raise _bad(f"node {name!r} ({op}) has axis {axis}, out of range for {value!r} of rank {rank}",
                       self.source, f"ONNX {op}'s axis lies in [-{rank}, {rank - 1}]")
        return axis % rank

    def op_TopK(self, name, ins, outs, a, consts):
        """``topk(x; k, dim, largest, sorted)`` with its two outputs (values, int64 indices; ties lowest
        index first, as ONNX says) for a constant ``K``; a run-time ``K`` stays unmapped.  ``K`` larger
        than the dim, or negative, is ``bad-model``."""
        x = ins[0]
        axis = self._axis("TopK", name, x, int(a.get("axis", -1)))
        if consts[1] is None or consts[1].size != 1:
            return self.add("unmapped:TopK", [v for v in ins if v], [o for o in outs if o], {}, "TopK", name)
        k, size = int(np.asarray(consts[1]).reshape(-1)[0]), self.g.shape(x)[axis]
        if not 0 <= k <= size:
            raise _bad(f"node {name!r} (TopK) has K={k}, out of range for dim {axis} of {x!r} (size {size})",
                       self.source, f"ONNX TopK's K lies in [0, {size}] for this input")
        values, indices = outs[0], outs[1] if len(outs) > 1 else ""
        if not indices:  # an unused indices output: a value of its own for topk's second output
            indices = self.new_value(f"{values}_indices", self.g.shape(values), "int64")
        elif self.g.values[indices].dtype != "int64":
            return self.add("unmapped:TopK", [v for v in ins if v], [o for o in outs if o], {}, "TopK", name)
        self.add("topk", [x], [values, indices], {"k": k, "dim": axis, "largest": bool(a.get("largest", 1)),
                                                   "sorted": bool(a.get("sorted", 1))}, "TopK", name)

    def op_ScatterElements(self, name, ins, outs, a, consts):
        """torch's scatter: ``scatter(x, index, src; dim)`` for reduction none, ``scatter_add`` for add (a
        constant index checked and taken into [0, s), a run-time one noted); mul, max and min stay unmapped."""
        data, idx, src = ins[:3]
        axis = self._axis("ScatterElements", name, data, int(a.get("axis", 0)))
        reduction = a.get("reduction", b"none")
        reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
        if reduction not in ("none", "add"):
            return self.add("unmapped:ScatterElements", ins[:3], outs, {}, "ScatterElements", name)
        idx = self._constant_index("ScatterElements", name, data, idx, axis, consts[1])
        self.add("scatter" if reduction == "none" else "scatter_add", [data, idx, src], outs, {"dim": axis},
                 "ScatterElements", name)

    def op_OneHot(self, name, ins, outs, a, consts):
        """``one_hot(indices; num_classes)`` (then a cast) for values ``[0, 1]`` on a new last axis and
        indices in ``[0, depth)``; other forms stay unmapped."""
        depth, values = consts[1], consts[2]
        rank = len(self.g.shape(outs[0]))
        if depth is None or values is None or values.size != 2 or list(values.reshape(-1)) != [0, 1] or \
                int(a.get("axis", -1)) % rank != rank - 1:
            return self.add("unmapped:OneHot", ins, outs, {}, "OneHot", name)
        hot = self.new_value(f"{outs[0]}_int64", self.g.shape(outs[0]), "int64")
        self.add("one_hot", ins[:1], [hot], {"num_classes": int(np.asarray(depth).reshape(-1)[0])}, "OneHot", name)
        self.add("cast", [hot], outs, {"dtype": self.g.values[outs[0]].dtype}, "OneHot", f"{name}_cast")

    def op_GatherND(self, name, ins, outs, a, consts):
        """``gather_nd(x, indices)`` (no batch dims: other forms stay unmapped)."""
        if int(a.get("batch_dims", 0)) != 0:
            return self.add("unmapped:GatherND", ins, outs, {}, "GatherND", name)
        self.add("gather_nd", ins[:2], outs, {}, "GatherND", name)

    def op_ScatterND(self, name, ins, outs, a, consts):
        """``scatter_nd(x, indices, updates; reduction)`` for reduction none or add."""
        reduction = a.get("reduction", b"none")
        reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
        if reduction not in ("none", "add"):
            return self.add("unmapped:ScatterND", ins, outs, {}, "ScatterND", name)
        self.add("scatter_nd", ins[:3], outs, {"reduction": reduction}, "ScatterND", name)

    def op_CumSum(self, name, ins, outs, a, consts):
        if consts[1] is None:
            return self.add("unmapped:CumSum", ins, outs, {}, "CumSum", name)
        rank = len(self.g.shape(ins[0]))
        self.add("cumsum", ins[:1], outs, {"dim": int(np.asarray(consts[1]).reshape(())) % rank,
                                           "exclusive": bool(a.get("exclusive", 0)),
                                           "reverse": bool(a.get("reverse", 0))}, "CumSum", name)

    def op_Attention(self, name, ins, outs, a, consts):
        """Opset 23's ``Attention`` on 4-D (B, N, S, D) inputs without a mask, a cache, a softcap or
        grouped heads, and with its other outputs unused: ``scaled_dot_product_attention``."""
        q, k, v = ins[:3]
        shapes = [self.g.shape(t) for t in (q, k, v)]
        plain = (all(len(s) == 4 for s in shapes) and shapes[0][1] == shapes[1][1] == shapes[2][1]
                 and not any(ins[3:]) and not any(outs[1:]) and not a.get("softcap", 0.0)
                 and not a.get("qk_matmul_output_mode", 0))
        if not plain or (a.get("is_causal", 0) and shapes[0][2] != shapes[1][2]):
            return self.add("unmapped:Attention", [t for t in ins if t], [o for o in outs if o], {}, "Attention", name)
        scale = a.get("scale")
        self.add("scaled_dot_product_attention", [q, k, v], outs[:1],
                 {"layout": "BNSD", "causal": bool(a.get("is_causal", 0)),
                  "scale": float(str(np.float32(scale))) if scale is not None else None}, "Attention", name)

    def op_RotaryEmbedding(self, name, ins, outs, a, consts):
        """The standard op (opset 23, and ``com.microsoft``'s when its position ids fold)."""
        microsoft = len(ins) >= 4 and self.g.values.get(ins[1]) is not None and \
            self.g.values[ins[1]].dtype == "int64" and self.g.shape(ins[2]) is not None and \
            len(self.g.shape(ins[2])) == 2 and consts[1] is not None
        if microsoft:  # (input, position_ids, cos_cache, sin_cache)
            x, pos, cos, sin = ins[:4]
            if consts[2] is None or consts[3] is None:
                return self.add("unmapped:RotaryEmbedding", ins, outs, {}, "RotaryEmbedding", name)
            cos_v, sin_v = consts[2][consts[1]], consts[3][consts[1]]
        else:  # (X, cos_cache, sin_cache[, position_ids])
            x, cos, sin = ins[:3]
            if len(ins) > 3 and ins[3]:
                if consts[3] is None or consts[1] is None or consts[2] is None:
                    return self.add("unmapped:RotaryEmbedding", ins, outs, {}, "RotaryEmbedding", name)
                cos_v, sin_v = consts[1][consts[3]], consts[2][consts[3]]
            else:
                cos_v = sin_v = None
        shape = self.g.shape(x)
        if len(shape) != 4 or a.get("rotary_embedding_dim", 0) not in (0, shape[-1]):
            return self.add("unmapped:RotaryEmbedding", ins, outs, {}, "RotaryEmbedding", name)
        interleaved = bool(a.get("interleaved", 0))
        full = []
        for base, v, arr in (("cos", cos, cos_v), ("sin", sin, sin_v)):
            if arr is not None:
                v = self.g.fresh(f"{name}_{base}_cache")
                self.const_value(v, arr)
            half = self.g.shape(v)  # (B, S, D/2)
            dtype = self.g.values[v].dtype
            if interleaved:  # each half-dim entry twice in a row: (B, S, D/2, 1) -> (B, S, D/2, 2) -> (B, S, D)
                col = self.new_value(f"{v}_col", tuple(half) + (1,), dtype)
                self.add("unsqueeze", [v], [col], {"dims": [len(half)]}, "RotaryEmbedding", f"{col}_n")
                pair = self.new_value(f"{v}_pair", tuple(half) + (2,), dtype)
                self.add("concat", [col, col], [pair], {"axis": len(half)}, "RotaryEmbedding", f"{pair}_n")
                wide = self.new_value(f"{v}_full", tuple(half[:-1]) + (half[-1] * 2,), dtype)
                self.add("reshape", [pair], [wide], {"shape": list(half[:-1]) + [half[-1] * 2]}, "RotaryEmbedding",
                         f"{wide}_n")
            else:
                wide = self.new_value(f"{v}_full", tuple(half[:-1]) + (half[-1] * 2,), dtype)
                self.add("concat", [v, v], [wide], {"axis": len(half) - 1}, "RotaryEmbedding", f"{wide}_n")
            heads = self.new_value(f"{v}_bnsd", (self.g.shape(wide)[0], 1) + self.g.shape(wide)[1:], dtype)
            self.add("unsqueeze", [wide], [heads], {"dims": [1]}, "RotaryEmbedding", f"{heads}_n")
            full.append(heads)
        self.add("rotary_position_embedding", [x, *full], outs[:1], {"mode": 1 if interleaved else 0},
                 "RotaryEmbedding", name)


def _too_large(name: str, op: str, shape: tuple[int, ...], source: str) -> SpecError:
    return limits.constant_too_large(f"folding constant node {name!r} ({op})", shape, "a folded constant", source,
                                     "constant subgraphs give shapes, indices and masks; check the model, or give "
                                     "smaller example shapes in the plan")


def _check_ranges(model, source: str) -> None:
    """Refuse a ``Range`` whose bounds are constants and that would give more than
    :data:`MAX_FOLD_ELEMENTS` values before shape inference runs: onnx's data propagation
    computes a Range's values itself, and would hold billions of them."""
    onnx = _onnx()
    graph = model.graph
    ranges = [n for n in graph.node if n.op_type == "Range" and n.domain in ("", "ai.onnx") and len(n.input) == 3]
    if not ranges:
        return
    tensors = {t.name: (t, f"initializer {t.name!r}") for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.output) == 1 and len(n.attribute) == 1 and \
                n.attribute[0].type == onnx.AttributeProto.TENSOR:
            tensors[n.output[0]] = (n.attribute[0].t, f"the value of node {n.name or n.output[0]!r} (Constant)")
    for n in ranges:
        found = [tensors.get(v) for v in n.input]
        if any(f is None or f[0].data_location == onnx.TensorProto.EXTERNAL or len(f[0].dims) > 1 for f in found):
            continue  # computed bounds: checked when the node is folded
        args = [_tensor_array(t, what, source)[0] for t, what in found]
        name = n.name or n.output[0]
        try:
            shape = _fold_shape("Range", args, {})
        except Exception as exc:
            why = _first_line(exc)
            raise _bad(f"cannot evaluate constant node {name!r} (Range): {why}", source) from None
        if math.prod(shape) > MAX_FOLD_ELEMENTS:
            raise _too_large(name, "Range", shape, source)


def _infer(model, source: str):
    """``onnx.shape_inference`` (strict, with data propagation) on ``model``; ``bad-model`` when it fails."""
    try:
        return _onnx().shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:
        raise _bad(f"shape inference failed on {source!r}: {str(exc).splitlines()[0] if str(exc) else exc!r}"[:400],
                   source) from None


def _static_shape(info) -> tuple[int, ...] | None:
    """The dims of a value's tensor type when every one is known, else None."""
    t = info.type.tensor_type
    if not t.HasField("shape") or any(not d.HasField("dim_value") for d in t.shape.dim):
        return None
    return tuple(int(d.dim_value) for d in t.shape.dim)


#: rounds of folding and shape inference at most (each round folds every chain it can reach; a
#: new round is needed only when a folded value fixes a shape that lets a ``Shape`` node fold)
MAX_FOLD_ROUNDS = 4


def _computed_initializers(model, torch_meta) -> frozenset[str]:
    """The float initializers computed from no parameter, which folding may go through (a
    parameter is never folded into a constant): those torch's node metadata shows read while no
    parameter names them (buffers such as a rotary ``inv_freq``, tables the exporter folded), and
    those named like a rotary buffer (:func:`~layout_prop.frontends.ir.is_computed_table`)."""
    from .ir import is_computed_table

    floats = {t.name for t in model.graph.initializer if _dtype_name(t.data_type).startswith("float")}
    computed = {name for name in floats if is_computed_table(name)}
    if torch_meta is not None:  # what _torch_parameters found
        names, read = torch_meta
        computed |= {v for v in read if v not in names}
    return frozenset(computed)


def _fold_constant_nodes(model, inferred, source: str, computed: frozenset[str] = frozenset()) -> int:
    """Replace each node whose inputs are all constants by a ``Constant`` node holding its value
    (the rules the reader folds by: :func:`_fold_table`, the :data:`MAX_FOLD_ELEMENTS` bound checked
    on the shape before anything is computed, float initializers of more than one element never
    folded, as they are weights), so that shape inference sees the shapes they give (TorchScript's
    ``expand(-1)``: ``ConstantOfShape -> Mul -> Equal -> Where`` into ``Expand``'s shape, which
    onnx's data propagation does not follow).  A node that cannot be folded is left for the reader,
    which reports it.  Returns how many nodes were replaced."""
    onnx = _onnx()
    graph = model.graph
    table = _fold_table()
    consts: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            continue
        array, _ = _tensor_array(init, f"initializer {init.name!r}", source)
        if init.name in computed or not (is_float_dtype(array.dtype) and array.size > 1):
            consts[init.name] = array
    shapes = {info.name: _static_shape(info) for info in
              list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output)}
    shapes.update({t.name: tuple(int(d) for d in t.dims) for t in graph.initializer})
    replaced = 0
    for k, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        name = node.name or node.output[0]
        try:
            attrs = _node_attrs(node, name, source)
            if node.op_type == "Constant":
                if len(node.attribute) == 1 and node.attribute[0].name == "value" and \
                        node.attribute[0].t.data_location != onnx.TensorProto.EXTERNAL:  # never an unread tensor
                    consts[node.output[0]] = attrs["value"]
                continue
            if node.op_type == "Shape" and len(node.input) == 1 and shapes.get(node.input[0]) is not None:
                result = np.array(shapes[node.input[0]], np.int64)[attrs.get("start", 0):attrs.get("end", None)]
            elif node.op_type in table and node.input and all(not v or v in consts for v in node.input):
                args = [consts[v] if v else None for v in node.input]
                if math.prod(_fold_shape(node.op_type, args, attrs)) > MAX_FOLD_ELEMENTS:
                    continue
                with np.errstate(all="ignore"):
                    result = np.asarray(table[node.op_type](args, attrs))
            else:
                continue
            tensor = onnx.numpy_helper.from_array(result)
        except Exception:  # the reader meets the node again and says what is wrong with it
            continue
        consts[node.output[0]] = result
        folded = onnx.helper.make_node("Constant", [], [node.output[0]], name=name, value=tensor)
        graph.node[k].CopyFrom(folded)
        replaced += 1
    return replaced


def read_onnx(path_or_model: Any, plan: ShardingPlan | None = None) -> ModelGraph:
    """Read an ONNX model into a :class:`ModelGraph` (no canonicalisation yet).

    When the reader meets a dim shape inference left dynamic (``dynamic-shape``), the model's
    constant chains are folded into ``Constant`` nodes (:func:`_fold_constant_nodes`) and shapes
    inferred again, up to :data:`MAX_FOLD_ROUNDS` times."""
    onnx = _onnx()
    model, source = _load(path_or_model)
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    _read_small_external_data(model_copy, source)
    _fix_input_shapes(model_copy, plan, source)
    _check_ranges(model_copy, source)
    inferred = _infer(model_copy, source)
    floats = {t.name for t in model_copy.graph.initializer if _dtype_name(t.data_type).startswith("float")}
    torch_meta = _torch_parameters(model_copy.graph, floats)
    computed = _computed_initializers(model_copy, torch_meta)
    rounds = 0
    while True:
        try:
            reader = _Reader(inferred, source, computed, torch_meta)
            reader.keep_modules = bool(plan is not None and plan.constraints)  # module paths a pin may name
            return reader.read()
        except SpecError as err:  # a dim left dynamic: fold what is constant, infer again (a static model pays nothing)
            rounds += 1
            if err.code != "dynamic-shape" or rounds > MAX_FOLD_ROUNDS or \
                    not _fold_constant_nodes(model_copy, inferred, source, computed):
                raise
            inferred = _infer(model_copy, source)


def from_onnx(path_or_model: Any, plan: ShardingPlan | str | Path | dict, *, opaque: bool = False,
              fuse: bool = True) -> Graph:
    """Import an ONNX model (a path or an ``onnx.ModelProto``) with a sharding plan.

    Parameters
    ----------
    path_or_model : str, Path or onnx.ModelProto
    plan : ShardingPlan, or a path, YAML/JSON text or dict of one (see :mod:`layout_prop.io.plan_file`)
    opaque : bool
        Treat ops the importer cannot map as barriers instead of refusing the model.
    fuse : bool
        Run the canonicalisation pass (RMSNorm, RoPE, SiLU, attention fusions).

    Returns
    -------
    Graph
        The same graph a spec gives, ready for :func:`layout_prop.api.analyze`.
    """
    from . import build_graph

    plan = plan if isinstance(plan, ShardingPlan) else load_plan(plan)
    return build_graph(read_onnx(path_or_model, plan), plan, opaque=opaque, fuse=fuse)
