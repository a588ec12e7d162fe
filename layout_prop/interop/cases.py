"""How each upstream op is called: the layout-prop op that executes it, sample shapes and extra args.

hyper-parallel's dispatcher hands a rule ``infer_layout(layouts, extra_args)``: one layout
per positional argument (``None`` for a non-tensor one) and the non-tensor arguments in
order; ops registered "with shape" get the input shapes as the last extra arg.  A
:class:`Case` writes one such call for one sample: the shapes of the tensor operands (in
our op's operand order), where each sits in upstream's ``layouts`` (``slots``), the
``extra_args``, and our op's attrs for the same call.  Shapes mix uneven dims (6 or 5 on 4
devices) and size-1 dims.

An upstream op with no entry in :data:`CASES` is listed as not mapped, with the reason
from :data:`NOT_MAPPED` (or "no audit case written" when none is given).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Case", "CASES", "NOT_MAPPED", "cases_for"]


@dataclass(frozen=True)
class Case:
    """One sample call of an upstream op and of the layout-prop op that executes it.

    Parameters
    ----------
    op : str
        The layout-prop op (canonical name or alias).
    shapes : tuple of tuple of int
        Global shapes of the tensor operands, in the layout-prop op's operand order.
    slots : tuple
        Upstream's ``layouts`` positions: an operand index, or None for a non-tensor argument.
    extra_args : Any
        Upstream's ``extra_args`` for this call.
    attrs : dict
        The layout-prop op's attrs for the same call.
    dtypes : tuple of str, optional
        Per operand (default float64 for all).
    int_high : tuple of int, optional
        Per operand, the exclusive upper bound of random integers (index operands).
    partial : bool
        Try ``P(sum)`` inputs too.
    kernel : str, optional
        A numpy kernel of :mod:`.judges` that executes the upstream op instead of ``op``'s
        own (an op layout-prop's registry lacks); ``op`` is then a stand-in rule of the same
        sharding behaviour, used only to tell an over-strict refusal, or None (no stand-in:
        a refusal is never called over-strict).
    gen : tuple, optional
        Per operand, how its global values are drawn: None (the default), ``"positive"``
        (uniform in [0.5, 2)), ``"int"`` (integers in [-4, 4], as floats) or
        ``("unique", dim, high)`` (integers in [0, high), distinct along ``dim``).
    outputs : tuple of int, optional
        Which of upstream's answered layouts hold our op's outputs, in order (default: the
        first ones).
    answer_attrs : dict, optional
        Attr name -> position in upstream's answer of a value the rule returns for the
        local call (Reshape's local shape, Slice's local begin and end): every rank's kernel
        gets it, as upstream's dispatcher passes it, instead of layout-prop's localized attrs.
    expansion : bool
        Run the rule's ``get_expand_impl`` around the kernel (False where it needs the
        platform layer, and the op computes the same without it).
    check : str, optional
        A check of :mod:`.judges` (``CHECKS``) that judges the assembled result by its
        invariants instead of by value (random ops).
    partial_as : dict, optional
        Upstream partial ops read as ours (``{"all": "min"}`` for a bool ``all``).
    call_values : dict, optional
        Position -> value of the non-tensor arguments of the call the expansion receives
        (the attention ops' scalars).
    call_attrs : dict, optional
        Attr name -> position in that call of a value the expansion adjusts for a rank's
        piece (head_num, sparse_mode...): the kernel gets it as the expansion passes it.
    call_kwargs : dict, optional
        Keyword arguments of the call the expansion receives (torch_npu's attention).
    tied : tuple of (int, int)
        (operand, other): the operand always takes the other's placements (attention's value
        takes key's, as the rules require).
    """

    op: str | None
    shapes: tuple
    slots: tuple
    extra_args: Any = ()
    attrs: dict = field(default_factory=dict)
    dtypes: tuple | None = None
    int_high: tuple | None = None
    partial: bool = True
    kernel: str | None = None
    gen: tuple | None = None
    outputs: tuple | None = None
    answer_attrs: dict = field(default_factory=dict)
    expansion: bool = True
    check: str | None = None
    partial_as: dict = field(default_factory=dict)
    call_values: dict = field(default_factory=dict)
    call_attrs: dict = field(default_factory=dict)
    tied: tuple = ()
    call_kwargs: dict = field(default_factory=dict)

    def describe(self) -> str:
        name = self.op if self.kernel is None else \
            self.kernel + (f" (stand-in rule {self.op})" if self.op else " (no layout-prop rule)")
        return f"{name} on shapes {[list(s) for s in self.shapes]}" + (f" {self.attrs}" if self.attrs else "")


def _shapes_arg(shapes) -> list:
    return [list(s) for s in shapes]


def _unary(op: str) -> list[Case]:
    return [Case(op, ((6, 1, 5),), (0,), ())]


def _binary(op: str, with_shapes: bool = True) -> list[Case]:
    out = []
    for shapes in (((6, 5), (6, 5)), ((6, 1, 5), (5,)), ((6, 5), (1, 5))):
        extra = [_shapes_arg(shapes)] if with_shapes else []
        out.append(Case(op, shapes, (0, 1), extra))
    return out


def _matmul(transposes=(False, False), extra: bool = True) -> Case:
    ta, tb = transposes
    x = (4, 6) if ta else (6, 4)
    w = (5, 4) if tb else (4, 5)
    return Case("matmul", (x, w), (0, 1), [ta, tb] if extra else [],
                {"transpose_a": ta, "transpose_b": tb})


def _build() -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = {}
    for name in ("ReLU", "Sigmoid", "Silu", "Cos", "Sin", "Neg", "Exp", "relu", "gelu", "rsqrt", "sigmoid", "silu",
                 "cos", "sin", "neg", "exp"):
        cases[name] = _unary(name)
    for name in ("Add", "Sub", "Mul", "Div", "RealDiv", "Minimum", "add", "sub", "mul", "div"):
        cases[name] = _binary(name)
    cases["MatMul"] = [_matmul((False, False)), _matmul((False, True)), _matmul((True, False))]
    cases["matmul"] = [_matmul((False, False), extra=False)]
    cases["MatMulExt"] = [_matmul((False, False), extra=False)]
    cases["BatchMatMul"] = [Case("batch_matmul", ((2, 6, 4), (2, 4, 5)), (0, 1), [False, False]),
                            Case("batch_matmul", ((2, 6, 4), (2, 5, 4)), (0, 1), [False, True],
                                 {"transpose_b": True})]
    for name in ("Dense", "linear"):
        cases[name] = [Case("linear", ((6, 4), (5, 4), (5,)), (0, 1, 2), []),
                       Case("linear", ((6, 4), (5, 4)), (0, 1, None), [])]
    for name in ("Softmax", "softmax"):
        cases[name] = [Case("softmax", ((6, 5),), (0,), [-1] if name == "softmax" else [(-1,)], {"axis": -1}),
                       Case("softmax", ((6, 1, 5),), (0,), [0] if name == "softmax" else [(0,)], {"axis": 0})]
    cases["RmsNorm"] = [Case("rms_norm", ((6, 5), (5,)), (0, 1, None), [1e-6], {"eps": 1e-6}, partial=False)]
    cases["layer_norm"] = [Case("layer_norm", ((6, 5), (5,), (5,)), (0, None, 1, 2), [[5], 1e-5], {"eps": 1e-5})]
    cases["topk"] = [Case("topk", ((6, 5),), (0,), [2, -1], {"k": 2, "dim": -1}),
                     Case("topk", ((6, 5),), (0,), [2, 0], {"k": 2, "dim": 0})]
    cases["sort"] = [Case("sort", ((6, 5),), (0,), [-1], {"dim": -1}), Case("sort", ((6, 5),), (0,), [0], {"dim": 0})]
    cases["GatherD"] = [Case("gather", ((6, 5), (6, 3)), (0, None, 1), [1], {"dim": 1}, dtypes=("float64", "int64"),
                             int_high=(0, 5)),
                        Case("gather", ((6, 5), (3, 5)), (0, None, 1), [0], {"dim": 0}, dtypes=("float64", "int64"),
                             int_high=(0, 6))]
    for name in ("Transpose", "permute"):
        cases[name] = [Case("transpose", ((6, 1, 5),), (0,), [(2, 0, 1)], {"dims": [2, 0, 1]})]
    for name in ("Concat", "cat"):
        cases[name] = [Case("concat", ((3, 5), (2, 5), (6, 5)), (0, 1, 2), [0], {"axis": 0}),
                       Case("concat", ((6, 1), (6, 5)), (0, 1), [1], {"axis": 1})]
    cases["cumsum"] = [Case("cumsum", ((6, 5),), (0,), [1], {"dim": 1}),
                       Case("cumsum", ((6, 5),), (0,), [0], {"dim": 0})]
    for name, op in (("sum", "sum"), ("mean", "mean")):
        cases[name] = [Case(op, ((6, 1, 5),), (0,), [[2], False], {"dims": [2], "keepdim": False}),
                       Case(op, ((6, 1, 5),), (0,), [[0], True], {"dims": [0], "keepdim": True})]
    for name in ("ExpandDims", "unsqueeze"):
        cases[name] = [Case("unsqueeze", ((6, 5),), (0,), [1], {"dim": 1})]
    for name, op in (("SumExt", "sum"), ("MeanExt", "mean"), ("ReduceMax", "max"), ("prod", "prod")):
        cases[name] = [Case(op, ((6, 1, 5),), (0,), [[2], False], {"dims": [2], "keepdim": False}),
                       Case(op, ((6, 1, 5),), (0,), [[0], True], {"dims": [0], "keepdim": True})]
    cases["max"] = [Case("max", ((6, 5),), (0,), [1, False], {"dims": [1], "keepdim": False})]
    cases["squeeze"] = [Case("squeeze", ((6, 1, 5),), (0,), [1, [[6, 1, 5]]], {"dim": 1})]
    cases["expand"] = [Case("expand", ((6, 1, 5),), (0,), [6, 4, 5], {"shape": [6, 4, 5]})]
    cases["repeat_interleave"] = [Case("repeat_interleave", ((6, 5),), (0,), [2, 1], {"repeats": 2, "dim": 1})]
    cases["pad"] = [Case("pad", ((6, 5),), (0,), [(1, 2)], {"pad": [1, 2]}),
                    Case("pad", ((6, 5),), (0,), [(0, 0, 2, 0)], {"pad": [0, 0, 2, 0]})]
    for name in ("Embedding", "embedding"):
        cases[name] = [Case("embedding", ((6, 3), (7, 5)), (0, 1), [], dtypes=("int64", "float64"),
                            int_high=(7, 0))]
    cases["isin"] = [Case("isin", ((6, 5), (4,)), (0, 1), [], dtypes=("int64", "int64"), int_high=(8, 8))]
    cases["new_ones"] = [Case("new_ones", ((6, 5),), (0,), [(3, 4)], {"shape": [3, 4]})]
    cases["IndexSelect"] = [Case("index_select", ((6, 5), (3,)), (0, None, 1), [0], {"dim": 0},
                                 dtypes=("float64", "int64"), int_high=(0, 6)),
                            Case("index_select", ((6, 5), (3,)), (0, None, 1), [1], {"dim": 1},
                                 dtypes=("float64", "int64"), int_high=(0, 5))]
    for name in ("Split", "split"):
        cases[name] = [Case("split2", ((6, 4),), (0,), [2, 1, [[6, 4]]], {"axis": 1}),
                       Case("split3", ((6, 4),), (0,), [2, 0, [[6, 4]]], {"axis": 0})]
    cases["unbind"] = [Case("unbind3", ((3, 5),), (0,), [0, [[3, 5]]], {"dim": 0}),
                       Case("unbind3", ((6, 3),), (0,), [1, [[6, 3]]], {"dim": 1})]
    cases["SliceExt"] = [Case("slice", ((6, 5),), (0,), [1, 1, 4, 1], {"axis": 1, "start": 1, "stop": 4}),
                         Case("slice", ((6, 5),), (0,), [0, 2, 6, 1], {"axis": 0, "start": 2, "stop": 6})]
    cases["ArgMaxWithValue"] = [  # (index, values); layout-prop's argmax gives the index, judged alone
        Case("argmax", ((6, 5),), (0, None, None), [1, False], {"dim": 1, "keepdim": False}),
        Case("argmax", ((6, 5),), (0, None, None), [0, True], {"dim": 0, "keepdim": True})]
    for name, op in (("AddExt", "add"), ("SubExt", "sub")):  # (x, y, alpha): alpha 1
        cases[name] = [Case(op, shapes, (0, 1, None), [1, _shapes_arg(shapes)])
                       for shapes in (((6, 5), (6, 5)), ((6, 1, 5), (5,)))]
    cases["real_div"] = _binary("div")
    for name in ("transpose", "TransposeExtView"):
        cases[name] = [Case("transpose", ((6, 1, 5),), (0, None, None), [0, 2], {"dim0": 0, "dim1": 2})]
    cases["pow"] = [Case("pow", ((6, 1, 5),), (0, None), [2.0, [[6, 1, 5]]], {"exponent": 2.0})]
    cases["masked_fill"] = [Case("masked_fill", shapes, (0, 1, None), [0.5, _shapes_arg(shapes)], {"value": 0.5},
                                 dtypes=("float64", "bool"), int_high=(0, 2))
                            for shapes in (((6, 5), (6, 5)), ((6, 5), (5,)))]
    cases["clone"] = [Case("identity", ((6, 1, 5),), (0,), [])]
    cases["Swiglu"] = [Case("swiglu", ((6, 4),), (0, None), [-1], {"dim": -1})]
    cases["TopkExt"] = [Case("topk", ((6, 5),), (0, None, None, None, None), [2, -1, True, True], {"k": 2, "dim": -1})]
    # the seed op: hyper-parallel's snapshot has no rule for it; a proposal registered by a user's module
    # (audit --module) is judged on cos/sin of x's rank and of lower rank (broadcast), mode 0
    cases["RotaryPositionEmbedding"] = [
        Case("rotary_position_embedding", ((2, 3, 5, 4), (1, 1, 5, 4), (1, 1, 5, 4)), (0, 1, 2), [0], {"mode": 0},
             partial=False),
        Case("rotary_position_embedding", ((2, 3, 5, 4), (5, 4), (5, 4)), (0, 1, 2), [0], {"mode": 0},
             partial=False)]
    _build_more(cases)
    return cases


_SHAPES2 = (((6, 5), (6, 5)), ((6, 1, 5), (5,)), ((6, 5), (1, 5)))


def _helper_binary(kernel: str, stand_in: str | None, with_shapes: bool, **kw) -> list[Case]:
    out = []
    for shapes in _SHAPES2:
        extra = [_shapes_arg(shapes)] if with_shapes else []
        out.append(Case(stand_in, shapes, (0, 1), extra, kernel=kernel, **kw))
    return out


def _build_more(cases: dict[str, list[Case]]) -> None:
    """The cases of the ops audited since the first snapshot run: helper kernels, local values, random ops."""
    # comparisons (a bool result), judged by numpy's; maximum's rule is the stand-in of a nonlinear binary op
    for name, kernel, with_shapes in (("GreaterEqual", "greater_equal", True), ("LessEqual", "less_equal", True),
                                      ("ge", "greater_equal", True), ("gt", "greater", True),
                                      ("le", "less_equal", True), ("lt", "less", True)):
        cases[name] = _helper_binary(kernel, "maximum", with_shapes)
    for name, kernel, with_shapes in (("NotEqual", "not_equal", False), ("not_equal", "not_equal", True),
                                      ("__eq__", "equal", True)):  # integer values, so that some are equal
        cases[name] = _helper_binary(kernel, "maximum", with_shapes, gen=("int", "int"))
    # logical ops on bools: or is maximum, and is minimum (no Partial of a bool: not tried)
    for name, kernel, stand_in in (("LogicalOr", "logical_or", "maximum"), ("__or__", "logical_or", "maximum"),
                                   ("__and__", "logical_and", "minimum")):
        cases[name] = _helper_binary(kernel, stand_in, True, dtypes=("bool", "bool"), int_high=(2, 2),
                                     partial=False)
    cases["__invert__"] = [Case("neg", ((6, 1, 5),), (0,), [], kernel="logical_not", dtypes=("bool",),
                                int_high=(2,), partial=False)]
    for name, kernel, with_shapes in (("FloorDiv", "floor_div", False), ("floor_div", "floor_div", True),
                                      ("__floordiv__", "floor_div", True), ("Mod", "mod", True)):
        cases[name] = _helper_binary(kernel, "maximum", with_shapes, gen=(None, "positive"))
    # unary ops: exp's rule is the stand-in of a nonlinear unary op
    for name, kernel in (("Log", "log"), ("log", "log"), ("Square", "square"), ("square", "square"),
                         ("abs", "abs")):
        cases[name] = [Case("exp", ((6, 1, 5),), (0,), [], kernel=kernel,
                            gen=("positive",) if kernel == "log" else None)]
    for name, kernel in (("AddScalar", "add_scalar"), ("SubScalar", "sub_scalar"), ("__rsub__", "rsub_scalar")):
        cases[name] = [Case("exp", ((6, 1, 5),), (0, None), [2.0], {"value": 2.0}, kernel=kernel)]
    # casts: layout-prop's cast op (a float to an integer is not linear in a partial sum)
    for name in ("Cast", "cast", "ToDtype"):
        cases[name] = [Case("cast", ((6, 1, 5),), (0, None), ["int64"], {"dtype": "int64"})]
    cases["long"] = [Case("cast", ((6, 1, 5),), (0,), [], {"dtype": "int64"})]
    cases["int"] = [Case("cast", ((6, 1, 5),), (0,), [], {"dtype": "int32"})]
    cases["float"] = [Case("cast", ((6, 1, 5),), (0,), [], {"dtype": "float32"}, dtypes=("int64",),
                           int_high=(9,))]
    for name in ("Contiguous", "contiguous"):  # no value changes: the identity
        cases[name] = [Case("identity", ((6, 1, 5),), (0,), [])]
    cases["CellBackwardHook"] = [Case("identity", ((6, 1, 5),), (0,), [])]  # forward: its tensors as they are
    cases["Tile"] = [Case(None, ((6, 5),), (0, None), [(2, 1)], {"reps": (2, 1)}, kernel="tile"),
                     Case(None, ((6, 5),), (0, None), [(1, 3)], {"reps": (1, 3)}, kernel="tile")]
    cases["all"] = [Case(None, ((6, 1, 5),), (0,), [[2], False], {"dims": [2], "keepdim": False}, kernel="all",
                         dtypes=("bool",), int_high=(2,), partial=False, partial_as={"all": "min"}),
                    Case(None, ((6, 1, 5),), (0,), [[0], True], {"dims": [0], "keepdim": True}, kernel="all",
                         dtypes=("bool",), int_high=(2,), partial=False, partial_as={"all": "min"})]
    # in-place and other names of audited ops
    cases["add_"] = _binary("add")
    cases["sub_"] = _binary("sub")
    cases["masked_fill_"] = list(cases["masked_fill"])
    cases["BatchMatMulExt"] = [Case("batch_matmul", ((2, 6, 4), (2, 4, 5)), (0, 1), []),
                               Case("batch_matmul", ((6, 4), (2, 4, 5)), (0, 1), [])]
    cases["expand_as"] = [Case(None, ((6, 1, 5), (6, 4, 5)), (0, 1), [[[6, 1, 5], [6, 4, 5]]], kernel="expand_as")]
    for name in ("SplitTensor", "SplitTensorView"):
        cases[name] = [Case("split2", ((6, 4),), (0,), [2, 1, [[6, 4]]], {"axis": 1}),
                       Case("split3", ((6, 4),), (0,), [2, 0, [[6, 4]]], {"axis": 0})]
    for name in ("SplitWithSize", "SplitWithSizeView"):
        cases[name] = [Case("split2", ((6, 4),), (0,), [[2, 2], 1], {"axis": 1}),
                       Case("split3", ((6, 4),), (0,), [[2, 2, 2], 0], {"axis": 0})]
    # local values the rule returns: Reshape's local shape, Slice's local begin and end (uneven dims matter)
    for name in ("Reshape", "reshape", "view"):
        cases[name] = [Case("reshape", (src,), (0,), [list(dst), list(src)], {"shape": list(dst)},
                            answer_attrs={"shape": 1})
                       for src, dst in (((6, 4), (24,)), ((6, 4), (3, 8)), ((2, 6, 5), (12, 5)),
                                        ((12, 5), (2, 6, 5)), ((8, 5), (2, 4, 5)))]
    cases["Slice"] = [Case(None, ((6, 5),), (0,), [(0, 1), (6, 4), (6, 5)], {"begin": (0, 1), "end": (6, 4)},
                           kernel="slice_begin_end", answer_attrs={"begin": 1, "end": 2}),
                      Case(None, ((8, 5),), (0,), [(2, 0), (6, 5), (8, 5)], {"begin": (2, 0), "end": (6, 5)},
                           kernel="slice_begin_end", answer_attrs={"begin": 1, "end": 2})]
    # index ops (packed arguments are unpacked by the dispatcher before infer_layout)
    cases["GatherNd"] = [Case("gather_nd", ((6, 5), (3, 1)), (0, 1), [[[6, 5], [3, 1]]], dtypes=("float64", "int64"),
                              int_high=(0, 6)),
                         Case("gather_nd", ((6, 5), (4, 2)), (0, 1), [[[6, 5], [4, 2]]],
                              dtypes=("float64", "int64"), int_high=(0, 5))]
    cases["ScatterUpdate"] = [Case("index_copy", ((6, 5), (3,), (3, 5)), (0, 1, 2), [], {"dim": 0},
                                   dtypes=("float64", "int64", "float64"), gen=(None, ("unique", 0, 6), None))]
    cases["scatter"] = [Case("scatter", ((6, 5), (6, 3), (6, 3)), (0, None, 1, 2), [1], {"dim": 1},
                             dtypes=("float64", "int64", "float64"), gen=(None, ("unique", 1, 5), None)),
                        Case("scatter", ((6, 5), (4, 5), (4, 5)), (0, None, 1, 2), [0], {"dim": 0},
                             dtypes=("float64", "int64", "float64"), gen=(None, ("unique", 0, 6), None))]
    cases["masked_scatter"] = [Case("masked_scatter", ((6, 5), (6, 5), (30,)), (0, 1, 2), [],
                                    dtypes=("float64", "bool", "float64"), int_high=(0, 2, 0))]
    # OneHotExt(indices, num_classes, on_value, off_value, axis): its expansion imports MindSpore, and with
    # num_classes given it calls the op as it is, so the op runs without it
    cases["OneHotExt"] = [Case("one_hot", ((6, 3),), (0, None, None, None, None), [5, 1, 0, -1], {"num_classes": 5},
                               dtypes=("int64",), int_high=(5,), expansion=False)]
    # a random op, judged by its invariants: shape, support, no repeat without replacement, replicas agree
    cases["multinomial"] = [Case("multinomial", ((6, 5),), (0, None, None), [3, False],
                                 {"num_samples": 3, "replacement": False}, gen=("positive",),
                                 check="multinomial_invariants"),
                            Case("multinomial", ((5,),), (0, None, None), [4, True],
                                 {"num_samples": 4, "replacement": True}, gen=("positive",),
                                 check="multinomial_invariants")]

    # attention: the rules' own expansions (no communication: they adjust head_num, the sparse mode and its
    # token windows, or sdpa's mask, for a rank's piece) run around layout-prop's kernels
    bnsd = ((2, 2, 5, 4),) * 3
    fa = []
    even = ((2, 2, 8, 4),) * 3  # the sequence 5 is cut unevenly on 4 devices (2, 2, 1, 0); 8 evenly
    for shapes, sparse_mode, pre, nxt in ((bnsd, 0, 2147483647, 2147483647), (bnsd, 3, 2147483647, 0),
                                          (even, 3, 2147483647, 0)):
        scalars = [2, 1.0, 0.5, pre, nxt, 0, "BNSD", sparse_mode]  # head_num ... sparse_mode, as MindSpore passes
        fa.append(Case("flash_attention_score", shapes, (0, 1, 2) + (None,) * 7, scalars,
                       {"head_num": 2, "input_layout": "BNSD", "scale": 0.5, "sparse_mode": sparse_mode,
                        "pre_tokens": pre, "next_tokens": nxt}, partial=False, outputs=(3,),
                       call_values={10 + i: v for i, v in enumerate(scalars)},
                       call_attrs={"head_num": 10, "pre_tokens": 13, "next_tokens": 14, "sparse_mode": 17},
                       tied=((2, 1),)))
    cases["FlashAttentionScore"] = fa
    # torch_npu's form: npu_fusion_attention(q, k, v, head_num, input_layout, scale=..., sparse_mode=...); the
    # dispatcher puts the keyword values after head_num and input_layout in extra_args; attention_out is first
    npu = []
    for shapes, sparse_mode, pre, nxt in ((bnsd, 0, 2147483647, 2147483647), (bnsd, 3, 2147483647, 0),
                                          (even, 3, 2147483647, 0)):
        keywords = {"scale": 0.5, "pre_tockens": pre, "next_tockens": nxt, "sparse_mode": sparse_mode}
        npu.append(Case("flash_attention_score", shapes, (0, 1, 2, None, None), [2, "BNSD", *keywords.values()],
                        {"head_num": 2, "input_layout": "BNSD", "scale": 0.5, "sparse_mode": sparse_mode,
                         "pre_tokens": pre, "next_tokens": nxt}, partial=False, outputs=(0,),
                        call_values={3: 2, 4: "BNSD"}, call_kwargs=keywords,
                        call_attrs={"head_num": 3, "pre_tokens": 10, "next_tokens": 11, "sparse_mode": 16},
                        tied=((2, 1),)))
    cases["npu_fusion_attention"] = npu
    cases["scaled_dot_product_attention"] = [
        Case("scaled_dot_product_attention", shapes, (0, 1, 2), [], {"layout": "BNSD"}, partial=False, tied=((2, 1),))
        for shapes in (bnsd, even)]


#: upstream op name -> its sample calls
CASES: dict[str, list[Case]] = _build()

#: upstream ops audit does not run, and why.  Every op of the shared snapshot has a case now (the reasons
#: written before they had, "layout-prop has no comparison ops" and the like, are gone with them); an op of
#: another checkout without a case is reported "no audit case written".  A reason given here must name no
#: op of :data:`CASES`.
NOT_MAPPED: dict[str, str] = {}


def cases_for(name: str) -> list[Case]:
    """The sample calls of upstream op ``name`` (empty when it is not mapped)."""
    return CASES.get(name, [])
