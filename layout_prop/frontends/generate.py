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
default), projections with biases (GPT-2's ``Conv1D``: a ``matmul`` and an ``add``; the fused
q/k/v projection ``c_attn`` split into q, k and v; the key's third of its bias adds the same
``q . b`` to every score of a query, which the softmax cancels, so its gradient is zero up to
rounding, as in GPT-2), dropout after the embeddings, the attention projection
and the MLP (each its own seed), a final LayerNorm, the head tied to the token embedding,
cross entropy.

:func:`moe_spec` writes Llama layers whose MLP is a Mixture of Experts (Mixtral,
Qwen3-MoE, DeepSeek-V3): a router (linear, softmax or sigmoid, top-k, weights renormalised
to sum to 1), ``moe_dispatch`` of the tokens to ``experts`` experts, SwiGLU experts as
batched matmuls on the expert weights (the fused gate and up ``(E, 2F, H)``, the down
``(E, H, F)``, each expert's ``(out, in)``) sharded on E over the ``ep`` mesh axis and on F over
tp, ``moe_combine``, plus ``shared_experts`` always-on SwiGLU experts.  The
mesh is (``dp``, ``ep``, ``tp``): activations are sharded on B by dp and ep (the expert
ranks are data parallel outside the experts) and on S by tp, so the dispatch into the
expert-sharded buffer is the all-to-all on ep, and the combine the one back.

Parameters are named as Hugging Face's models name them, so a plan pastes into a transformers
model: ``gen llama`` as ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ``model.norm.weight``, ``lm_head.weight``), ``gen gpt``
as ``GPT2LMHeadModel`` (``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``: its
``Conv1D`` weights are ``(in, out)``, read by ``matmul``, and ``c_attn`` is q, k and v fused, cut
by the strided shard ``_S(1,3)`` on tp), ``gen moe`` as Mixtral, Qwen3-MoE and DeepSeek-V3 in
transformers 5 (``model.layers.0.mlp.gate.weight``, ``model.layers.0.mlp.experts.gate_up_proj``,
``model.layers.0.mlp.shared_experts.gate_proj.weight``).  The rotary tables ``cos`` and ``sin``
take no gradient (a model's buffers), and the token ids, labels and ``x`` are model inputs.  The
nodes keep short names: ``l<i>_<what>`` in decoder layer i (``l0_q``, ``l0_attn``), which the
pipeline, recomputation and ZeRO passes read as the layer.

Examples
--------
>>> spec = llama_spec(layers=2)
>>> len(spec["nodes"]), sorted(spec["inputs"])[:2]
(46, ['cos', 'model.layers.0.input_layernorm.weight'])
>>> spec["outputs"]
['l1_out']
>>> full = llama_spec(layers=1, full=True, kv_heads=2, vocab=64)
>>> full["inputs"]["model.layers.0.self_attn.k_proj.weight"]["shape"], full["nodes"][-1]["op"], full["outputs"]
([16, 32], 'cross_entropy_combine', ['loss'])
>>> moe = moe_spec(layers=1, experts=4, top_k=2)
>>> [n["op"] for n in moe["nodes"] if n["op"].startswith("moe_")]
['moe_dispatch', 'moe_combine']
"""

from __future__ import annotations

from typing import Sequence

from layout_prop.core.errors import SpecError, cut

__all__ = ["llama_spec", "gpt_spec", "moe_spec", "parse_mesh_arg", "llama_layer_names", "gpt_layer_names",
           "moe_layer_names", "ROUTERS", "MESH_AXES"]

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


def _heads(b: _Builder, p: str, name: str, lin: str, batch: int, seq: int, n: int, head_dim: int) -> str:
    """A projection's output ``(B, S, n * D)`` split into heads, ``(B, n, S, D)``."""
    split = b.node(p + name + "_heads", "reshape", [lin], shape=[batch, seq, n, head_dim])
    return b.node(p + name + "_bnsd", "transpose", [split], dims=[0, 2, 1, 3])


def _attend(b: _Builder, p: str, q: str, k: str, v: str, batch: int, seq: int, hidden: int, rope: bool, mode: int,
            context_parallel: str) -> str:
    """RoPE on the heads of ``q`` and ``k`` (``rope``), causal attention, the heads merged: ``(B, S, H)``."""
    if rope:
        q = b.node(p + "q_rot", "rotary_position_embedding", [q, "cos", "sin"], mode=mode)
        k = b.node(p + "k_rot", "rotary_position_embedding", [k, "cos", "sin"], mode=mode)
    cp = {} if context_parallel == "all_gather" else {"context_parallel": context_parallel}
    attn = b.node(p + "attn", "scaled_dot_product_attention", [q, k, v], layout="BNSD", causal=True, **cp)
    attn_bsnd = b.node(p + "attn_bsnd", "transpose", [attn], dims=[0, 2, 1, 3])
    return b.node(p + "attn_merged", "reshape", [attn_bsnd], shape=[batch, seq, hidden])


def _attention(b: _Builder, p: str, w: dict[str, str], h: str, batch: int, seq: int, hidden: int, heads: int,
               kv_heads: int, mode: int, context_parallel: str = "all_gather") -> str:
    """Llama's attention of ``h``: the Q/K/V projections (GQA when kv_heads < heads) by the weights
    ``w["q"]``, ``w["k"]``, ``w["v"]`` (``nn.Linear``'s ``(out, in)``), RoPE, causal attention and
    the output projection ``w["o"]``: the name of its output.  Weight inputs must exist already."""
    head_dim = hidden // heads
    bnsd = {name: _heads(b, p, name, b.node(p + name, "linear", [h, w[name]]), batch, seq, n, head_dim)
            for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    merged = _attend(b, p, bnsd["q"], bnsd["k"], bnsd["v"], batch, seq, hidden, True, mode, context_parallel)
    return b.node(p + "attn_out", "linear", [merged, w["o"]])


#: Hugging Face's LlamaForCausalLM names (``nn.Linear`` weights are ``(out, in)``, as ``linear`` takes them)
LLAMA_EMBED, LLAMA_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def llama_layer_names(i: int) -> dict[str, str]:
    """The parameter names of Llama decoder layer ``i`` by role, as ``LlamaForCausalLM`` has them.

    >>> llama_layer_names(3)["q"]
    'model.layers.3.self_attn.q_proj.weight'
    """
    p = f"model.layers.{i}."
    return {"norm1": p + "input_layernorm.weight", "q": p + "self_attn.q_proj.weight",
            "k": p + "self_attn.k_proj.weight", "v": p + "self_attn.v_proj.weight",
            "o": p + "self_attn.o_proj.weight", "norm2": p + "post_attention_layernorm.weight",
            "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight", "down": p + "mlp.down_proj.weight"}


def _llama_attention_params(b: _Builder, w: dict[str, str], hidden: int, heads: int, kv_heads: int) -> None:
    col, row = b.placements(tp="S(0)"), b.placements(tp="S(1)")
    kv = kv_heads * (hidden // heads)
    for role, shape, pl in (("norm1", [hidden], b.placements()), ("q", [hidden, hidden], col),
                            ("k", [kv, hidden], col), ("v", [kv, hidden], col),
                            ("o", [hidden, hidden], row), ("norm2", [hidden], b.placements())):
        b.param(w[role], shape, pl)


def _swiglu_params(b: _Builder, w: dict[str, str], hidden: int, ffn: int) -> None:
    """The gate, up (column-parallel) and down (row-parallel) weights of a SwiGLU MLP, ``(out, in)``."""
    col, row = b.placements(tp="S(0)"), b.placements(tp="S(1)")
    for role, shape, pl in (("gate", [ffn, hidden], col), ("up", [ffn, hidden], col), ("down", [hidden, ffn], row)):
        b.param(w[role], shape, pl)


def _llama_layer(b: _Builder, p: str, w: dict[str, str], x: str, batch: int, seq: int, hidden: int, heads: int,
                 kv_heads: int, mode: int, context_parallel: str = "all_gather") -> str:
    """One Llama decoder layer with a SwiGLU MLP (its weights ``w`` exist already): its output."""
    h = b.node(p + "h", "rms_norm", [x, w["norm1"]], eps=1e-6)
    proj = _attention(b, p, w, h, batch, seq, hidden, heads, kv_heads, mode, context_parallel)
    x1 = b.node(p + "res1", "add", [x, proj])
    h2 = b.node(p + "h2", "rms_norm", [x1, w["norm2"]], eps=1e-6)
    gate = b.node(p + "gate", "linear", [h2, w["gate"]])
    up = b.node(p + "up", "linear", [h2, w["up"]])
    act_out = b.node(p + "swiglu", "silu_mul", [gate, up])
    down = b.node(p + "down", "linear", [act_out, w["down"]])
    return b.node(p + "out", "add", [x1, down])


def _rope_inputs(b: _Builder, seq: int, head_dim: int, seq_axis: str | None) -> None:
    pl = b.placements(**{seq_axis: "S(2)"}) if seq_axis else b.placements()
    for name in ("cos", "sin"):
        b.param(name, [1, 1, seq, head_dim], pl, requires_grad=False)


def _lm_inputs(b: _Builder, batch: int, seq: int, vocab: int, hidden: int, ids_placements: list[str],
               table: str) -> str:
    """Token ids and labels ``(B, S)`` and the vocabulary-parallel embedding ``table``; the embedded tokens."""
    b.param("tokens", [batch, seq], ids_placements, dtype="int64", requires_grad=False)
    b.param("labels", [batch, seq], ids_placements, dtype="int64", requires_grad=False)
    b.param(table, [vocab, hidden], b.placements(tp="S(0)"))
    return b.node("embedded", "embedding", ["tokens", table])


def _lm_head(b: _Builder, h: str, vocab: int, hidden: int, table: str | None) -> str:
    """The output head (the embedding ``table`` when given: tied; else ``lm_head.weight``) and the
    mean cross entropy: the loss.

    The head is vocabulary-parallel (rows on tp), so the logits are sharded on the
    vocabulary, and the loss is Megatron's vocab-parallel cross entropy in its three nodes
    (the max, the per-token parts, the combine: an all-reduce of the max and of three
    numbers a token on tp; the logits never move).
    """
    if table is None:
        table = b.param(LM_HEAD, [vocab, hidden], b.placements(tp="S(0)"))
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
    if full:
        x = _lm_inputs(b, batch, seq, vocab, hidden, b.placements(dp="S(0)", sp="S(1)"), LLAMA_EMBED)
    else:
        x = b.param("x", [batch, seq, hidden], act)
    _rope_inputs(b, seq, hidden // heads, "sp")
    for i in range(layers):
        w = llama_layer_names(i)
        _llama_attention_params(b, w, hidden, heads, kv_heads)
        _swiglu_params(b, w, hidden, ffn)
        x = _llama_layer(b, f"l{i}_", w, x, batch, seq, hidden, heads, kv_heads, mode, context_parallel)
    if not full:
        return b.spec([x])
    b.param(LLAMA_NORM, [hidden], b.placements())
    h = b.node("final_h", "rms_norm", [x, LLAMA_NORM], eps=1e-6)
    return b.spec([_lm_head(b, h, vocab, hidden, LLAMA_EMBED if tie_embeddings else None)])


#: GPT2LMHeadModel's names (its head is tied to ``transformer.wte.weight``)
GPT_WTE, GPT_WPE, GPT_LN_F = "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f"
_GPT_MODULES = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")


def gpt_layer_names(i: int) -> dict[str, str]:
    """GPT-2 block ``i``'s parameter names, by their name under ``transformer.h.i.``.

    >>> gpt_layer_names(0)["attn.c_attn.weight"]
    'transformer.h.0.attn.c_attn.weight'
    """
    return {f"{m}.{kind}": f"transformer.h.{i}.{m}.{kind}" for m in _GPT_MODULES for kind in ("weight", "bias")}


def _gpt_layer_params(b: _Builder, hidden: int, ffn: int) -> list[tuple[str, list[int], list[str]]]:
    """``(name under the block, shape, placements)`` of a GPT-2 block's parameters.

    GPT-2's projections are ``Conv1D``: ``x @ weight + bias``, the weight ``(in, out)`` (the
    transpose of ``nn.Linear``'s), so column-parallel is the weight's dim 1 on tp and
    row-parallel its dim 0.  ``c_attn`` is q, k and v fused, ``[q | k | v]`` along its out dim:
    column-parallel, each tp rank holds its columns of each third, the strided shard
    ``_S(1,3)`` (``_S(0,3)`` for the bias), so the split into q, k and v is local.
    """
    rep = b.placements()
    col, row = b.placements(tp="S(1)"), b.placements(tp="S(0)")
    return [("ln_1.weight", [hidden], rep), ("ln_1.bias", [hidden], rep),
            ("attn.c_attn.weight", [hidden, 3 * hidden], b.placements(tp="_S(1,3)")),
            ("attn.c_attn.bias", [3 * hidden], b.placements(tp="_S(0,3)")),
            ("attn.c_proj.weight", [hidden, hidden], row), ("attn.c_proj.bias", [hidden], rep),
            ("ln_2.weight", [hidden], rep), ("ln_2.bias", [hidden], rep),
            ("mlp.c_fc.weight", [hidden, ffn], col), ("mlp.c_fc.bias", [ffn], b.placements(tp="S(0)")),
            ("mlp.c_proj.weight", [ffn, hidden], row), ("mlp.c_proj.bias", [hidden], rep)]


def _conv1d(b: _Builder, name: str, x: str, w: dict[str, str], module: str) -> str:
    """GPT-2's ``Conv1D`` of ``x``: ``matmul`` by the ``(in, out)`` weight, then the bias added."""
    y = b.node(name + "_mm", "matmul", [x, w[module + ".weight"]])
    return b.node(name, "add", [y, w[module + ".bias"]])


def gpt_spec(layers: int = 1, mesh: Sequence[tuple[str, int]] = (("dp", 2), ("sp", 2), ("tp", 2)),
             batch: int = 2, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int | None = None,
             vocab: int = 64, dropout: float = 0.1, dtype: str = "float32") -> dict:
    """The spec dict of a GPT-3 training graph (see the module docstring); ``ffn`` defaults to 4 x hidden."""
    ffn = 4 * hidden if ffn is None else ffn
    _check_sizes(layers, hidden, heads, None, vocab)
    if not 0.0 <= dropout < 1.0:
        raise SpecError("bad-value", f"dropout must be in [0, 1), got {dropout}", hint="give --dropout 0.1, or 0")
    b = _Builder(mesh, dtype)
    tok = _lm_inputs(b, batch, seq, vocab, hidden, b.placements(dp="S(0)", sp="S(1)"), GPT_WTE)
    b.param(GPT_WPE, [seq, hidden], b.placements())  # learned positions 0..S-1, added to every sequence
    x = b.node("embedded_pos", "add", [tok, GPT_WPE])
    seeds = iter(range(1, 3 * layers + 2))
    x = b.node("embed_drop", "dropout", [x], p=dropout, seed=next(seeds))
    for i in range(layers):
        p, w = f"l{i}_", gpt_layer_names(i)
        for role, shape, pl in _gpt_layer_params(b, hidden, ffn):
            b.param(w[role], shape, pl)
        h = b.node(p + "h", "layer_norm", [x, w["ln_1.weight"], w["ln_1.bias"]], eps=1e-5)
        qkv = _conv1d(b, p + "qkv", h, w, "attn.c_attn")
        b.node(p + "qkv_split", "split", [qkv], split_size_or_sections=[hidden] * 3, axis=-1)
        q, k, v = (_heads(b, p, name, f"{p}qkv_split:{j}", batch, seq, heads, hidden // heads)
                   for j, name in enumerate("qkv"))
        merged = _attend(b, p, q, k, v, batch, seq, hidden, False, 0, "all_gather")
        proj = _conv1d(b, p + "attn_out", merged, w, "attn.c_proj")
        proj = b.node(p + "attn_drop", "dropout", [proj], p=dropout, seed=next(seeds))
        x1 = b.node(p + "res1", "add", [x, proj])
        h2 = b.node(p + "h2", "layer_norm", [x1, w["ln_2.weight"], w["ln_2.bias"]], eps=1e-5)
        act = b.node(p + "gelu", "gelu", [_conv1d(b, p + "fc1", h2, w, "mlp.c_fc")])
        fc2 = _conv1d(b, p + "fc2", act, w, "mlp.c_proj")
        fc2 = b.node(p + "mlp_drop", "dropout", [fc2], p=dropout, seed=next(seeds))
        x = b.node(p + "out", "add", [x1, fc2])
    b.param(GPT_LN_F + ".weight", [hidden], b.placements())
    b.param(GPT_LN_F + ".bias", [hidden], b.placements())
    h = b.node("final_h", "layer_norm", [x, GPT_LN_F + ".weight", GPT_LN_F + ".bias"], eps=1e-5)
    return b.spec([_lm_head(b, h, vocab, hidden, GPT_WTE)])


def moe_layer_names(i: int) -> dict[str, str]:
    """MoE decoder layer ``i``'s parameter names by role, as Hugging Face's Mixtral, Qwen3-MoE and
    DeepSeek-V3 have them (transformers 5): the router ``mlp.gate.weight`` ``(E, H)``, the experts'
    fused gate and up projections ``mlp.experts.gate_up_proj`` ``(E, 2F, H)`` (gate the first F
    rows) and ``mlp.experts.down_proj`` ``(E, H, F)``, each expert's ``(out, in)`` as ``nn.Linear``;
    DeepSeek-V3's ``mlp.shared_experts.*_proj.weight``; a dense layer's MLP is Llama's.

    >>> moe_layer_names(1)["gate_up"]
    'model.layers.1.mlp.experts.gate_up_proj'
    """
    p = f"model.layers.{i}.mlp."
    return {**llama_layer_names(i), "router": p + "gate.weight", "gate_up": p + "experts.gate_up_proj",
            "e_down": p + "experts.down_proj", "s_gate": p + "shared_experts.gate_proj.weight",
            "s_up": p + "shared_experts.up_proj.weight", "s_down": p + "shared_experts.down_proj.weight"}


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
        x = _lm_inputs(b, batch, seq, vocab, hidden, b.placements(dp="S(0)", ep="S(0)"), LLAMA_EMBED)
    else:
        x = b.param("x", [batch, seq, hidden], act)
    _rope_inputs(b, seq, hidden // heads, None)
    routing = {"num_experts": experts, "capacity_factor": capacity_factor, "groups": groups}
    if capacity_scope != "global":
        routing["capacity_scope"] = capacity_scope
    for i in range(layers):
        p, w = f"l{i}_", moe_layer_names(i)
        _llama_attention_params(b, w, hidden, heads, kv_heads)
        if i < dense_layers:  # a dense SwiGLU MLP, Megatron's column- and row-parallel linears
            _swiglu_params(b, w, hidden, dense_ffn or ffn)
            x = _llama_layer(b, p, w, x, batch, seq, hidden, heads, kv_heads, mode)
            continue
        b.param(w["router"], [experts, hidden], b.placements())
        # each tp rank holds its F / tp rows of the gate half and of the up half: the strided shard
        b.param(w["gate_up"], [experts, 2 * ffn, hidden], b.placements(ep="S(0)", tp="_S(1,2)"))
        b.param(w["e_down"], [experts, hidden, ffn], b.placements(ep="S(0)", tp="S(2)"))
        if shared_experts:
            _swiglu_params(b, {role: w["s_" + role] for role in ("gate", "up", "down")}, hidden,
                           shared_experts * ffn)
        h = b.node(p + "h", "rms_norm", [x, w["norm1"]], eps=1e-6)
        proj = _attention(b, p, w, h, batch, seq, hidden, heads, kv_heads, mode)
        x1 = b.node(p + "res1", "add", [x, proj])
        h2 = b.node(p + "h2", "rms_norm", [x1, w["norm2"]], eps=1e-6)
        t = b.node(p + "tokens", "reshape", [h2], shape=[tokens, hidden])
        logits = b.node(p + "router_logits", "linear", [t, w["router"]])
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
        gate_up = b.node(p + "e_gate_up_out", "batch_matmul", [buf, w["gate_up"]], transpose_b=True)
        b.node(p + "e_gate_up", "split", [gate_up], split_size_or_sections=[ffn, ffn], axis=-1)
        e_act = b.node(p + "e_swiglu", "silu_mul", [p + "e_gate_up:0", p + "e_gate_up:1"])
        e_down = b.node(p + "e_down_out", "batch_matmul", [e_act, w["e_down"]], transpose_b=True)
        moe = b.node(p + "combine", "moe_combine", [e_down, p + "topk:1", weights], **routing)
        if shared_experts:
            s_gate = b.node(p + "s_gate_out", "linear", [t, w["s_gate"]])
            s_up = b.node(p + "s_up_out", "linear", [t, w["s_up"]])
            s_act = b.node(p + "s_swiglu", "silu_mul", [s_gate, s_up])
            s_down = b.node(p + "s_down_out", "linear", [s_act, w["s_down"]])
            moe = b.node(p + "moe_sum", "add", [moe, s_down])
        y = b.node(p + "moe_out", "reshape", [moe], shape=[batch, seq, hidden])
        x = b.node(p + "out", "add", [x1, y])
    if not full:
        return b.spec([x])
    b.param(LLAMA_NORM, [hidden], b.placements())
    h = b.node("final_h", "rms_norm", [x, LLAMA_NORM], eps=1e-6)
    return b.spec([_lm_head(b, h, vocab, hidden, LLAMA_EMBED if tie_embeddings else None)])
