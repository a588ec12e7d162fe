"""Spec generators for whole models: Llama decoder layers or a Llama training graph, GPT-3, and MoE.

:func:`llama_spec` writes the spec of N Llama layers: RMSNorm, Q/K/V linears, reshape to
heads, RotaryPositionEmbedding on q and k, causal attention, output projection, residual
add, RMSNorm, SwiGLU MLP, residual add.  The sharding is Megatron's, on a mesh whose
axes are data parallel (``dp``), sequence/context parallel (``sp``) and tensor parallel
(``tp``, innermost, as TP is placed within a node):

- activations ``(B, S, H)`` are sharded on B by dp and on S by sp and then tp (Megatron
  sequence parallelism outside the tensor-parallel regions);
- the Q/K/V, gate and up weights are column-parallel (out dim on tp), the output and
  down projections row-parallel (in dim on tp), norm weights replicated;
- cos and sin ``(1, 1, S, D)`` are sharded on S by sp, like q and k.

So the reshard pass must insert what Megatron does by hand: an all-gather on tp before
each column-parallel matmul, a reduce-scatter on tp after each row-parallel one, and an
all-gather of k and v on sp before attention (each rank's query rows get their causal
offset through a localised attr).  ``kv_heads`` below ``heads`` gives grouped-query
attention (k and v projections of ``kv_heads * head_dim`` rows).

With ``full=True`` the spec is a training graph: token ids and labels ``(B, S)`` in, a
vocabulary-parallel embedding (table rows on tp), the layers, a final RMSNorm, the output
head (column-parallel, or the embedding table itself with ``tie_embeddings``) and the
mean cross entropy of the next-token labels out (one scalar), in Megatron's
vocabulary-parallel form (max, cross_entropy_parts, cross_entropy_combine: the logits
never move).

:func:`gpt_spec` writes GPT-3 (Megatron-LM's GPT): token and learned position embeddings,
pre-LayerNorm layers of attention (no RoPE) and a GELU MLP of ``ffn`` (4 x hidden by
default), linears with biases (but the key projection: a key bias adds the same
``q . b`` to every score of a query, which the softmax cancels, so its gradient is zero and
only rounding noise would be compared), dropout after the embeddings, the attention projection
and the MLP (each its own seed), a final LayerNorm, the head tied to the token embedding,
cross entropy.

:func:`moe_spec` writes Llama layers whose MLP is a Mixture of Experts (Mixtral,
Qwen3-MoE, DeepSeek-V3): a router (linear, softmax or sigmoid, top-k, weights renormalised
to sum to 1), ``moe_dispatch`` of the tokens to ``experts`` experts, SwiGLU experts as
batched matmuls on expert weights ``(E, H, F)`` sharded on E over the ``ep`` mesh axis and
on F over tp, ``moe_combine``, plus ``shared_experts`` always-on SwiGLU experts.  The
mesh is (``dp``, ``ep``, ``tp``): activations are sharded on B by dp and ep (the expert
ranks are data parallel outside the experts) and on S by tp, so the dispatch into the
expert-sharded buffer is the all-to-all on ep, and the combine the one back.

Examples
--------
>>> spec = llama_spec(layers=2)
>>> len(spec["nodes"]), sorted(spec["inputs"])[:3]
(46, ['cos', 'l0_norm1', 'l0_norm2'])
>>> spec["outputs"]
['l1_out']
>>> full = llama_spec(layers=1, full=True, kv_heads=2, vocab=64)
>>> full["inputs"]["l0_wk"]["shape"], full["nodes"][-1]["op"], full["outputs"]
([16, 32], 'cross_entropy_combine', ['loss'])
>>> moe = moe_spec(layers=1, experts=4, top_k=2)
>>> [n["op"] for n in moe["nodes"] if n["op"].startswith("moe_")]
['moe_dispatch', 'moe_combine']
"""

from __future__ import annotations

from typing import Sequence

from layout_prop.core.errors import SpecError, cut

__all__ = ["llama_spec", "gpt_spec", "moe_spec", "parse_mesh_arg", "ROUTERS", "MESH_AXES"]

#: the router scores ``gen moe`` offers
ROUTERS = ("softmax", "sigmoid")
#: the mesh axes each generator needs, in order
MESH_AXES = {"llama": ("dp", "sp", "tp"), "gpt": ("dp", "sp", "tp"), "moe": ("dp", "ep", "tp")}


def parse_mesh_arg(text: str, model: str = "llama", pipeline: bool = False) -> list[tuple[str, int]]:
    """``"dp=2,sp=2,tp=2"`` -> ``[("dp", 2), ("sp", 2), ("tp", 2)]``, in the order written; ``model`` names the
    axes taken (:data:`MESH_AXES`), and with ``pipeline`` a ``pp`` axis too. An axis of the model not written
    has size 1 (appended in the model's order); an axis the model does not take is ``bad-mesh``.

    >>> parse_mesh_arg("pp=8,dp=24,tp=8", pipeline=True)
    [('pp', 8), ('dp', 24), ('sp', 1), ('tp', 8)]
    """
    out = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        size = size.strip()  # ASCII digits only ('²' and '٢' pass isdigit), and few of them (int() refuses 4,300)
        if not name or not (size.isascii() and size.isdigit() and len(size) <= 18) or int(size) < 1:
            raise SpecError("bad-mesh", f"cannot read mesh {cut(text, 60)} at {cut(part, 60)}",
                            hint="write the mesh as " + ",".join(f"{a}=2" for a in MESH_AXES[model]))
        out.append((name.strip(), int(size)))
    names = [n for n, _ in out]
    need = MESH_AXES[model]
    taken = need + (("pp",) if pipeline else ())
    unknown = [n for n in names if n not in taken]
    if unknown or len(set(names)) != len(names):
        example = ",".join(f"{a}=2" for a in need)
        title = {"llama": "Llama", "gpt": "GPT", "moe": "MoE"}[model]
        raise SpecError("bad-mesh", f"the {title} generator needs exactly the mesh axes {', '.join(need[:-1])} and "
                        f"{need[-1]}{' (and pp)' if pipeline else ''}, got {names}",
                        hint=f"write the mesh as {example} (sizes may be 1; an axis left out has size 1)")
    for i, axis in enumerate(need):  # an axis left out goes before the next of the model's axes written
        if axis not in names:
            later = [j for j, (n, _) in enumerate(out) if n in need[i + 1:]]
            out.insert(later[0] if later else len(out), (axis, 1))
            names = [n for n, _ in out]
    return out


class _Builder:
    """Collects a spec's inputs and nodes; placements by mesh axis name."""

    def __init__(self, mesh: Sequence[tuple[str, int]], dtype: str):
        self.names = [n for n, _ in mesh]
        self.sizes = [s for _, s in mesh]
        self.axis = {n: i for i, n in enumerate(self.names)}
        self.dtype = dtype
        self.inputs: dict = {}
        self.nodes: list[dict] = []

    def placements(self, **by_axis: str) -> list[str]:
        ps = ["R"] * len(self.names)
        for name, p in by_axis.items():
            if name in self.axis:
                ps[self.axis[name]] = p
        return ps

    def param(self, name: str, shape: list[int], placements: list[str], **extra) -> str:
        self.inputs[name] = {"shape": shape, "placements": placements, "dtype": extra.pop("dtype", self.dtype),
                             **extra}
        return name

    def node(self, name: str, op: str, args: list[str], **attrs) -> str:
        self.nodes.append({"name": name, "op": op, "inputs": args, "attrs": attrs})
        return name

    def spec(self, outputs: list[str]) -> dict:
        return {"mesh": {"shape": self.sizes, "names": self.names}, "inputs": self.inputs, "nodes": self.nodes,
                "outputs": outputs}


def _check_sizes(layers: int, hidden: int, heads: int, kv_heads: int | None = None, vocab: int | None = None,
                 seq: int | None = None) -> None:
    if layers < 1:
        raise SpecError("bad-value", f"layers must be at least 1, got {layers}", hint="use --layers 1 or more")
    if hidden % heads:
        raise SpecError("bad-value", f"hidden {hidden} is not divisible by heads {heads}",
                        hint="choose heads that divide hidden")
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise SpecError("bad-value", f"kv-heads {kv_heads} does not divide heads {heads}",
                        hint="choose kv-heads that divide heads (grouped-query attention), e.g. 1, or heads itself")
    if vocab is not None and vocab < 2:
        raise SpecError("bad-value", f"vocab must be at least 2, got {vocab}",
                        hint="give --vocab 2 or more (a language model predicts one of several tokens)")


def _attention(b: _Builder, p: str, x: str, h: str, batch: int, seq: int, hidden: int, heads: int, kv_heads: int,
               rope: bool, mode: int, bias: bool, context_parallel: str = "all_gather") -> str:
    """Q/K/V projections of ``h`` (GQA when kv_heads < heads), attention, the output projection,
    the residual add to ``x``: the name of the sum.  Weight inputs must exist already."""
    head_dim = hidden // heads
    heads_bnsd = {}
    for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        args = [h, p + "w" + name] + ([p + "b" + name] if bias and name != "k" else [])
        lin = b.node(p + name, "linear", args)
        split = b.node(p + name + "_heads", "reshape", [lin], shape=[batch, seq, n, head_dim])
        heads_bnsd[name] = b.node(p + name + "_bnsd", "transpose", [split], dims=[0, 2, 1, 3])
    q, k = heads_bnsd["q"], heads_bnsd["k"]
    if rope:
        q = b.node(p + "q_rot", "rotary_position_embedding", [q, "cos", "sin"], mode=mode)
        k = b.node(p + "k_rot", "rotary_position_embedding", [k, "cos", "sin"], mode=mode)
    cp = {} if context_parallel == "all_gather" else {"context_parallel": context_parallel}
    attn = b.node(p + "attn", "scaled_dot_product_attention", [q, k, heads_bnsd["v"]], layout="BNSD", causal=True,
                  **cp)
    attn_bsnd = b.node(p + "attn_bsnd", "transpose", [attn], dims=[0, 2, 1, 3])
    merged = b.node(p + "attn_merged", "reshape", [attn_bsnd], shape=[batch, seq, hidden])
    proj = b.node(p + "attn_out", "linear", [merged, p + "wo"] + ([p + "bo"] if bias else []))
    return proj


def _llama_attention_params(b: _Builder, p: str, hidden: int, heads: int, kv_heads: int) -> None:
    col, row = b.placements(tp="S(0)"), b.placements(tp="S(1)")
    kv = kv_heads * (hidden // heads)
    for w, shape, pl in (("norm1", [hidden], b.placements()), ("wq", [hidden, hidden], col),
                         ("wk", [kv, hidden], col), ("wv", [kv, hidden], col),
                         ("wo", [hidden, hidden], row), ("norm2", [hidden], b.placements())):
        b.param(p + w, shape, pl)


def _rope_inputs(b: _Builder, seq: int, head_dim: int, seq_axis: str | None) -> None:
    pl = b.placements(**{seq_axis: "S(2)"}) if seq_axis else b.placements()
    for name in ("cos", "sin"):
        b.param(name, [1, 1, seq, head_dim], pl, requires_grad=False)


def _lm_inputs(b: _Builder, batch: int, seq: int, vocab: int, hidden: int, ids_placements: list[str]) -> str:
    """Token ids and labels ``(B, S)`` and the vocabulary-parallel embedding table; the embedded tokens."""
    b.param("tokens", [batch, seq], ids_placements, dtype="int64", requires_grad=False)
    b.param("labels", [batch, seq], ids_placements, dtype="int64", requires_grad=False)
    b.param("embed", [vocab, hidden], b.placements(tp="S(0)"))
    return b.node("embedded", "embedding", ["tokens", "embed"])


def _lm_head(b: _Builder, h: str, vocab: int, hidden: int, tie: bool) -> str:
    """The output head (the embedding table when tied) and the mean cross entropy: the loss.

    The head is vocabulary-parallel (rows on tp), so the logits are sharded on the
    vocabulary, and the loss is Megatron's vocab-parallel cross entropy in its three nodes
    (the max, the per-token parts, the combine: an all-reduce of the max and of three
    numbers a token on tp; the logits never move).
    """
    table = "embed"
    if not tie:
        table = b.param("head", [vocab, hidden], b.placements(tp="S(0)"))
    logits = b.node("logits", "linear", [h, table])
    m = b.node("logits_max", "max", [logits], dims=[-1])
    parts = b.node("loss_parts", "cross_entropy_parts", [logits, "labels", m])
    return b.node("loss", "cross_entropy_combine", [parts, m, "labels"], num_classes=vocab)


def llama_spec(layers: int = 1, mesh: Sequence[tuple[str, int]] = (("dp", 2), ("sp", 2), ("tp", 2)),
               batch: int = 2, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int = 64,
               dtype: str = "float32", mode: int = 0, kv_heads: int | None = None, full: bool = False,
               vocab: int = 64, tie_embeddings: bool = False, context_parallel: str = "all_gather") -> dict:
    """The spec dict of ``layers`` Llama decoder layers, or with ``full`` the training graph
    (see the module docstring); ``context_parallel`` is the attention's (``ring``: ring
    attention on ``sp``)."""
    kv_heads = heads if kv_heads is None else kv_heads
    _check_sizes(layers, hidden, heads, kv_heads, vocab if full else None)
    b = _Builder(mesh, dtype)
    act = b.placements(dp="S(0)", sp="S(1)", tp="S(1)")
    col = b.placements(tp="S(0)")  # weight (out, in): out dim on tp
    row = b.placements(tp="S(1)")  # weight (out, in): in dim on tp
    if full:
        x = _lm_inputs(b, batch, seq, vocab, hidden, b.placements(dp="S(0)", sp="S(1)"))
    else:
        x = b.param("x", [batch, seq, hidden], act)
    _rope_inputs(b, seq, hidden // heads, "sp")
    for i in range(layers):
        p = f"l{i}_"
        _llama_attention_params(b, p, hidden, heads, kv_heads)
        for w, shape, pl in (("w_gate", [ffn, hidden], col), ("w_up", [ffn, hidden], col),
                             ("w_down", [hidden, ffn], row)):
            b.param(p + w, shape, pl)
        h = b.node(p + "h", "rms_norm", [x, p + "norm1"], eps=1e-6)
        proj = _attention(b, p, x, h, batch, seq, hidden, heads, kv_heads, True, mode, False, context_parallel)
        x1 = b.node(p + "res1", "add", [x, proj])
        h2 = b.node(p + "h2", "rms_norm", [x1, p + "norm2"], eps=1e-6)
        gate = b.node(p + "gate", "linear", [h2, p + "w_gate"])
        up = b.node(p + "up", "linear", [h2, p + "w_up"])
        act_out = b.node(p + "swiglu", "silu_mul", [gate, up])
        down = b.node(p + "down", "linear", [act_out, p + "w_down"])
        x = b.node(p + "out", "add", [x1, down])
    if not full:
        return b.spec([x])
    b.param("final_norm", [hidden], b.placements())
    h = b.node("final_h", "rms_norm", [x, "final_norm"], eps=1e-6)
    return b.spec([_lm_head(b, h, vocab, hidden, tie_embeddings)])


def gpt_spec(layers: int = 1, mesh: Sequence[tuple[str, int]] = (("dp", 2), ("sp", 2), ("tp", 2)),
             batch: int = 2, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int | None = None,
             vocab: int = 64, dropout: float = 0.1, dtype: str = "float32") -> dict:
    """The spec dict of a GPT-3 training graph (see the module docstring); ``ffn`` defaults to 4 x hidden."""
    ffn = 4 * hidden if ffn is None else ffn
    _check_sizes(layers, hidden, heads, None, vocab)
    if not 0.0 <= dropout < 1.0:
        raise SpecError("bad-value", f"dropout must be in [0, 1), got {dropout}", hint="give --dropout 0.1, or 0")
    b = _Builder(mesh, dtype)
    col, row = b.placements(tp="S(0)"), b.placements(tp="S(1)")
    tok = _lm_inputs(b, batch, seq, vocab, hidden, b.placements(dp="S(0)", sp="S(1)"))
    b.param("pos_embed", [seq, hidden], b.placements())  # learned positions 0..S-1, added to every sequence
    x = b.node("embedded_pos", "add", [tok, "pos_embed"])
    seeds = iter(range(1, 3 * layers + 2))
    x = b.node("embed_drop", "dropout", [x], p=dropout, seed=next(seeds))
    for i in range(layers):
        p = f"l{i}_"
        for w, shape, pl in (("ln1_w", [hidden], b.placements()), ("ln1_b", [hidden], b.placements()),
                             ("wq", [hidden, hidden], col), ("bq", [hidden], col),
                             ("wk", [hidden, hidden], col),
                             ("wv", [hidden, hidden], col), ("bv", [hidden], col),
                             ("wo", [hidden, hidden], row), ("bo", [hidden], b.placements()),
                             ("ln2_w", [hidden], b.placements()), ("ln2_b", [hidden], b.placements()),
                             ("w_fc1", [ffn, hidden], col), ("b_fc1", [ffn], col),
                             ("w_fc2", [hidden, ffn], row), ("b_fc2", [hidden], b.placements())):
            b.param(p + w, shape, pl)
        h = b.node(p + "h", "layer_norm", [x, p + "ln1_w", p + "ln1_b"], eps=1e-5)
        proj = _attention(b, p, x, h, batch, seq, hidden, heads, heads, False, 0, True)
        proj = b.node(p + "attn_drop", "dropout", [proj], p=dropout, seed=next(seeds))
        x1 = b.node(p + "res1", "add", [x, proj])
        h2 = b.node(p + "h2", "layer_norm", [x1, p + "ln2_w", p + "ln2_b"], eps=1e-5)
        fc1 = b.node(p + "fc1", "linear", [h2, p + "w_fc1", p + "b_fc1"])
        act = b.node(p + "gelu", "gelu", [fc1])
        fc2 = b.node(p + "fc2", "linear", [act, p + "w_fc2", p + "b_fc2"])
        fc2 = b.node(p + "mlp_drop", "dropout", [fc2], p=dropout, seed=next(seeds))
        x = b.node(p + "out", "add", [x1, fc2])
    b.param("final_ln_w", [hidden], b.placements())
    b.param("final_ln_b", [hidden], b.placements())
    h = b.node("final_h", "layer_norm", [x, "final_ln_w", "final_ln_b"], eps=1e-5)
    return b.spec([_lm_head(b, h, vocab, hidden, True)])


def _dense_moe_layer(b: _Builder, p: str, x: str, batch: int, seq: int, hidden: int, heads: int, kv_heads: int,
                     mode: int, ffn: int) -> str:
    """One of ``moe_spec``'s first dense layers: attention and a SwiGLU MLP; the name of its output."""
    col, row = b.placements(tp="S(0)"), b.placements(tp="S(1)")
    for w, shape, pl in (("w_gate", [ffn, hidden], col), ("w_up", [ffn, hidden], col),
                         ("w_down", [hidden, ffn], row)):
        b.param(p + w, shape, pl)
    h = b.node(p + "h", "rms_norm", [x, p + "norm1"], eps=1e-6)
    proj = _attention(b, p, x, h, batch, seq, hidden, heads, kv_heads, True, mode, False)
    x1 = b.node(p + "res1", "add", [x, proj])
    h2 = b.node(p + "h2", "rms_norm", [x1, p + "norm2"], eps=1e-6)
    gate = b.node(p + "gate", "linear", [h2, p + "w_gate"])
    up = b.node(p + "up", "linear", [h2, p + "w_up"])
    down = b.node(p + "down", "linear", [b.node(p + "swiglu", "silu_mul", [gate, up]), p + "w_down"])
    return b.node(p + "out", "add", [x1, down])


def moe_spec(layers: int = 1, mesh: Sequence[tuple[str, int]] = (("dp", 2), ("ep", 2), ("tp", 2)),
             batch: int = 4, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int = 32,
             experts: int = 4, top_k: int = 2, capacity_factor: float | None = None, capacity_scope: str = "global",
             shared_experts: int = 0,
             router: str = "softmax", kv_heads: int | None = None, dtype: str = "float32", mode: int = 0,
             full: bool = False, vocab: int = 64, tie_embeddings: bool = False, dense_layers: int = 0,
             dense_ffn: int | None = None) -> dict:
    """The spec dict of ``layers`` MoE decoder layers (see the module docstring); ``ffn`` is each
    expert's inner size, a shared expert has the same.  The first ``dense_layers`` layers have a
    dense SwiGLU MLP of ``dense_ffn`` (default ``ffn``) instead, as DeepSeek-V3's first three."""
    kv_heads = heads if kv_heads is None else kv_heads
    _check_sizes(layers, hidden, heads, kv_heads, vocab if full else None)
    if experts < 1:
        raise SpecError("bad-value", f"experts must be at least 1, got {experts}", hint="give --experts 1 or more")
    if not 1 <= top_k <= experts:
        raise SpecError("bad-value", f"top-k {top_k} is not in 1..{experts} (the number of experts)",
                        hint="give --top-k at most --experts")
    if capacity_factor is not None and not capacity_factor > 0:
        raise SpecError("bad-value", f"capacity-factor must be positive, got {capacity_factor}",
                        hint="leave --capacity-factor out (no token dropped) or give e.g. 1.25")
    if capacity_scope not in ("global", "group"):
        raise SpecError("bad-value", f"capacity-scope {capacity_scope!r} is not global or group",
                        hint="give --capacity-scope global (the default) or group")
    if shared_experts < 0:
        raise SpecError("bad-value", f"shared-experts must be at least 0, got {shared_experts}",
                        hint="give --shared-experts 0 or more")
    if not 0 <= dense_layers <= layers:
        raise SpecError("bad-value", f"dense-layers {dense_layers} is not in 0..{layers} (the layers)",
                        hint="give --dense-layers at most --layers")
    if router not in ROUTERS:
        raise SpecError("bad-value", f"router {router!r} is not one of {list(ROUTERS)}", hint="give --router softmax "
                        "(Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3)")
    b = _Builder(mesh, dtype)
    size = dict(zip(b.names, b.sizes))
    act = b.placements(dp="S(0)", ep="S(0)", tp="S(1)")
    tokens = batch * seq
    # a rank holds whole token groups when each (dp, ep) rank holds one whole sequence, split on S by tp
    groups = size["dp"] * size["ep"] * (size["tp"] if batch == size["dp"] * size["ep"] else 1)
    if batch % (size["dp"] * size["ep"]) or tokens % groups:
        groups = 1  # tokens that do not cut into whole groups are gathered for the dispatch
    if full:
        x = _lm_inputs(b, batch, seq, vocab, hidden, b.placements(dp="S(0)", ep="S(0)"))
    else:
        x = b.param("x", [batch, seq, hidden], act)
    _rope_inputs(b, seq, hidden // heads, None)
    col, row = b.placements(tp="S(0)"), b.placements(tp="S(1)")
    routing = {"num_experts": experts, "capacity_factor": capacity_factor, "groups": groups}
    if capacity_scope != "global":
        routing["capacity_scope"] = capacity_scope
    for i in range(layers):
        p = f"l{i}_"
        _llama_attention_params(b, p, hidden, heads, kv_heads)
        if i < dense_layers:  # a dense SwiGLU MLP, Megatron's column- and row-parallel linears
            x = _dense_moe_layer(b, p, x, batch, seq, hidden, heads, kv_heads, mode, dense_ffn or ffn)
            continue
        b.param(p + "router", [experts, hidden], b.placements())
        b.param(p + "e_gate", [experts, hidden, ffn], b.placements(ep="S(0)", tp="S(2)"))
        b.param(p + "e_up", [experts, hidden, ffn], b.placements(ep="S(0)", tp="S(2)"))
        b.param(p + "e_down", [experts, ffn, hidden], b.placements(ep="S(0)", tp="S(1)"))
        if shared_experts:
            shared = shared_experts * ffn
            for w, shape, pl in (("s_gate", [shared, hidden], col), ("s_up", [shared, hidden], col),
                                 ("s_down", [hidden, shared], row)):
                b.param(p + w, shape, pl)
        h = b.node(p + "h", "rms_norm", [x, p + "norm1"], eps=1e-6)
        proj = _attention(b, p, x, h, batch, seq, hidden, heads, kv_heads, True, mode, False)
        x1 = b.node(p + "res1", "add", [x, proj])
        h2 = b.node(p + "h2", "rms_norm", [x1, p + "norm2"], eps=1e-6)
        t = b.node(p + "tokens", "reshape", [h2], shape=[tokens, hidden])
        logits = b.node(p + "router_logits", "linear", [t, p + "router"])
        if router == "softmax":
            scores = b.node(p + "scores", "softmax", [logits], axis=-1)
        else:
            scores = b.node(p + "scores", "sigmoid", [logits])
        b.node(p + "topk", "topk", [scores], k=top_k, dim=-1)  # values topk:0, indices topk:1
        total = b.node(p + "topk_sum", "sum", [p + "topk:0"], dims=[-1], keepdim=True)
        weights = b.node(p + "route_w", "div", [p + "topk:0", total])
        buf = b.node(p + "dispatch", "moe_dispatch", [t, p + "topk:1"], **routing)
        # expert parallelism, as Megatron moves the tokens: the all-to-all on ep, then an all-gather on tp
        # before the column-parallel experts (the reshard pass inserts the combine's moves back)
        buf = b.node(p + "to_experts", "redistribute", [buf], placements=b.placements(dp="S(1)", ep="S(0)"))
        gate = b.node(p + "e_gate_out", "batch_matmul", [buf, p + "e_gate"])
        up = b.node(p + "e_up_out", "batch_matmul", [buf, p + "e_up"])
        e_act = b.node(p + "e_swiglu", "silu_mul", [gate, up])
        e_down = b.node(p + "e_down_out", "batch_matmul", [e_act, p + "e_down"])
        moe = b.node(p + "combine", "moe_combine", [e_down, p + "topk:1", weights], **routing)
        if shared_experts:
            s_gate = b.node(p + "s_gate_out", "linear", [t, p + "s_gate"])
            s_up = b.node(p + "s_up_out", "linear", [t, p + "s_up"])
            s_act = b.node(p + "s_swiglu", "silu_mul", [s_gate, s_up])
            s_down = b.node(p + "s_down_out", "linear", [s_act, p + "s_down"])
            moe = b.node(p + "moe_sum", "add", [moe, s_down])
        y = b.node(p + "moe_out", "reshape", [moe], shape=[batch, seq, hidden])
        x = b.node(p + "out", "add", [x1, y])
    if not full:
        return b.spec([x])
    b.param("final_norm", [hidden], b.placements())
    h = b.node("final_h", "rms_norm", [x, "final_norm"], eps=1e-6)
    return b.spec([_lm_head(b, h, vocab, hidden, tie_embeddings)])
