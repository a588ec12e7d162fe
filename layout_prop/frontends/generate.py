"""Spec generators for whole models: a Llama decoder block, repeated N times.

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
offset through a localised attr).

Examples
--------
>>> spec = llama_spec(layers=2)
>>> len(spec["nodes"]), sorted(spec["inputs"])[:3]
(46, ['cos', 'l0_norm1', 'l0_norm2'])
>>> spec["outputs"]
['l1_out']
"""

from __future__ import annotations

from typing import Sequence

from layout_prop.core.errors import SpecError

__all__ = ["llama_spec", "parse_mesh_arg"]


def parse_mesh_arg(text: str) -> list[tuple[str, int]]:
    """``"dp=2,sp=2,tp=2"`` -> ``[("dp", 2), ("sp", 2), ("tp", 2)]``."""
    out = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise SpecError("bad-mesh", f"cannot read mesh {text!r} at {part!r}",
                            hint="write the mesh as dp=2,sp=2,tp=2")
        out.append((name.strip(), int(size)))
    names = [n for n, _ in out]
    missing = sorted({"dp", "sp", "tp"} - set(names))
    if missing or len(names) != 3:
        raise SpecError("bad-mesh", f"the Llama generator needs exactly the mesh axes dp, sp and tp, got {names}",
                        hint="write the mesh as dp=2,sp=2,tp=2 (sizes may be 1)")
    return out


def llama_spec(layers: int = 1, mesh: Sequence[tuple[str, int]] = (("dp", 2), ("sp", 2), ("tp", 2)),
               batch: int = 2, seq: int = 8, hidden: int = 32, heads: int = 4, ffn: int = 64,
               dtype: str = "float32", mode: int = 0) -> dict:
    """The spec dict of ``layers`` Llama decoder layers (see the module docstring)."""
    if layers < 1:
        raise SpecError("bad-value", f"layers must be at least 1, got {layers}", hint="use --layers 1 or more")
    if hidden % heads:
        raise SpecError("bad-value", f"hidden {hidden} is not divisible by heads {heads}",
                        hint="choose heads that divide hidden")
    names = [n for n, _ in mesh]
    axis = {n: i for i, n in enumerate(names)}
    head_dim = hidden // heads

    def placements(**by_axis: str) -> list[str]:
        ps = ["R"] * len(names)
        for name, p in by_axis.items():
            ps[axis[name]] = p
        return ps

    act = placements(dp="S(0)", sp="S(1)", tp="S(1)")
    col = placements(tp="S(0)")  # weight (out, in): out dim on tp
    row = placements(tp="S(1)")  # weight (out, in): in dim on tp
    inputs: dict = {
        "x": {"shape": [batch, seq, hidden], "placements": act, "dtype": dtype},
        "cos": {"shape": [1, 1, seq, head_dim], "placements": placements(sp="S(2)"), "dtype": dtype,
                "requires_grad": False},
        "sin": {"shape": [1, 1, seq, head_dim], "placements": placements(sp="S(2)"), "dtype": dtype,
                "requires_grad": False},
    }
    nodes: list[dict] = []

    def node(name: str, op: str, args: list[str], **attrs) -> str:
        nodes.append({"name": name, "op": op, "inputs": args, "attrs": attrs})
        return name

    x = "x"
    for i in range(layers):
        p = f"l{i}_"
        for w, shape, pl in (("norm1", [hidden], placements()), ("wq", [hidden, hidden], col),
                             ("wk", [hidden, hidden], col), ("wv", [hidden, hidden], col),
                             ("wo", [hidden, hidden], row), ("norm2", [hidden], placements()),
                             ("w_gate", [ffn, hidden], col), ("w_up", [ffn, hidden], col),
                             ("w_down", [hidden, ffn], row)):
            inputs[p + w] = {"shape": shape, "placements": pl, "dtype": dtype}
        h = node(p + "h", "rms_norm", [x, p + "norm1"], eps=1e-6)
        heads_bnsd = {}
        for name in ("q", "k", "v"):
            lin = node(p + name, "linear", [h, p + "w" + name])
            split = node(p + name + "_heads", "reshape", [lin], shape=[batch, seq, heads, head_dim])
            heads_bnsd[name] = node(p + name + "_bnsd", "transpose", [split], dims=[0, 2, 1, 3])
        q = node(p + "q_rot", "rotary_position_embedding", [heads_bnsd["q"], "cos", "sin"], mode=mode)
        k = node(p + "k_rot", "rotary_position_embedding", [heads_bnsd["k"], "cos", "sin"], mode=mode)
        attn = node(p + "attn", "scaled_dot_product_attention", [q, k, heads_bnsd["v"]], layout="BNSD",
                    causal=True)
        attn_bsnd = node(p + "attn_bsnd", "transpose", [attn], dims=[0, 2, 1, 3])
        merged = node(p + "attn_merged", "reshape", [attn_bsnd], shape=[batch, seq, hidden])
        proj = node(p + "attn_out", "linear", [merged, p + "wo"])
        x1 = node(p + "res1", "add", [x, proj])
        h2 = node(p + "h2", "rms_norm", [x1, p + "norm2"], eps=1e-6)
        gate = node(p + "gate", "linear", [h2, p + "w_gate"])
        up = node(p + "up", "linear", [h2, p + "w_up"])
        act_out = node(p + "swiglu", "silu_mul", [gate, up])
        down = node(p + "down", "linear", [act_out, p + "w_down"])
        x = node(p + "out", "add", [x1, down])
    return {"mesh": {"shape": [s for _, s in mesh], "names": names}, "inputs": inputs, "nodes": nodes,
            "outputs": [x]}
