"""The backward of Megatron's layouts moves what Megatron-LM's collectives move (issue #30).

``gen llama --mesh dp=2,sp=1,tp=4`` (one layer, batch 2, seq 8, hidden 32, ffn 64, fp32) writes
Megatron-LM's layouts with sequence parallelism: activations S(0) on dp and the sequence S(1) on
tp, q/k/v/gate/up column-parallel (weight dim 0 on tp), wo/w_down row-parallel (weight dim 1 on
tp), the norm weights replicated.  The bytes each rank sends in one training step, counted by
hand from Megatron-LM's collectives (ring algorithms; an all-gather or a reduce-scatter over n
ranks sends (n - 1) blocks, an all-reduce 2 (n - 1) / n of the buffer):

- one activation block: [2, 8, 32] fp32 = 2048 bytes, / 2 on dp, / 4 on tp = 256 bytes a rank;
- forward, on tp: all-gather before q/k/v and before gate/up, reduce-scatter after wo and after
  w_down: 4 x 3 x 256 = 3,072;
- backward, on tp, the mirror: all-gather of the output cotangent of w_down and of wo (which both
  the input and the weight gradient read), reduce-scatter of the input gradient of gate/up and of
  q/k/v: 4 x 768 = 3,072;
- weight gradients, all-reduced over dp=2 (2 x 1/2 x the local shard): wq, wk, wv, wo 32 x 32 fp32
  / 4 on tp = 1,024 each, w_gate, w_up, w_down 64 x 32 / 4 = 2,048 each, the two norm weights 128
  each: 4,096 + 6,144 + 256 = 10,496;
- the norm-weight gradients over tp (each tp rank saw other tokens): 2 x (2 x 3/4 x 128) = 384;

17,024 bytes in all.  Megatron-LM itself also all-gathers the norm outputs once more in the
backward (it does not keep the gathered copy), 2 x 768 more: 18,560; layout-prop keeps the
gathered value of the forward, so 17,024 is the figure.
"""

from __future__ import annotations

from collections import Counter

from layout_prop.api import analyze
from layout_prop.frontends.generate import llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.runner import run_graph

MESH = (("dp", 2), ("sp", 1), ("tp", 4))
BLOCK = 2 * 8 * 32 * 4 // 2 // 4  # one rank's piece of an activation, bytes
TP_MOVE = 3 * BLOCK  # ring all-gather or reduce-scatter over tp=4
FORWARD = 4 * TP_MOVE
BACKWARD = 4 * TP_MOVE
DP_GRADS = 4 * (32 * 32 * 4 // 4) + 3 * (64 * 32 * 4 // 4) + 2 * (32 * 4)
TP_NORM_GRADS = 2 * (2 * 3 * (32 * 4) // 4)
HAND_COUNT = FORWARD + BACKWARD + DP_GRADS + TP_NORM_GRADS


def _moves():
    a = analyze(load_spec(llama_spec(1, mesh=MESH)), reshard=True, backward=True)
    assert a.ok
    return a.check


def test_the_hand_count_is_17024():
    assert (FORWARD, BACKWARD, DP_GRADS, TP_NORM_GRADS) == (3072, 3072, 10496, 384)
    assert HAND_COUNT == 17024


def test_megatron_layouts_move_the_hand_count():
    check = _moves()
    assert check.total_bytes_per_rank == HAND_COUNT
    steps = Counter((s.kind, s.mesh_axis_name, s.bytes_per_rank)
                    for r in check.redistributions for s in r.plan.steps if s.bytes_per_rank)
    assert steps == Counter({
        ("all-gather", "tp", TP_MOVE): 4,  # forward 2, backward 2
        ("reduce-scatter", "tp", TP_MOVE): 4,  # forward 2, backward 2
        ("all-reduce", "dp", 1024): 4,  # wq, wk, wv, wo
        ("all-reduce", "dp", 2048): 3,  # w_gate, w_up, w_down
        ("all-reduce", "dp", 128): 2,  # the norm weights
        ("all-reduce", "tp", 192): 2,  # the norm weights, over the tokens on tp
    })


def test_the_weight_gradients_read_the_gathered_cotangent():
    # the weight gradient of wo reads the cotangent the input gradient gathered: no all-to-all
    # of the merged attention output, no tp-partial full matrix reduce-scattered afterwards
    check = _moves()
    assert not [r for r in check.redistributions if r.node == "grad/l0_attn_out/einsum2"]
    wo = [r for r in check.redistributions if r.node == "grad/model.layers.0.self_attn.o_proj.weight"]
    assert [[s.kind for s in r.plan.steps] for r in wo] == [["all-reduce"]]
    assert str(wo[0].plan.src.layout) == "(P(sum), P(sum), S(1))"  # already S(1) on tp, partial on dp
    assert not [s for r in check.redistributions for s in r.plan.steps if s.kind == "all-to-all"]


def test_megatron_layouts_run_equal_to_one_device():
    rep = run_graph(load_spec(llama_spec(1, mesh=MESH)), backward=True, seed=2)
    assert rep.ok, rep.mismatches
    assert len(rep.grads) == 10  # x, the two norm weights, the seven matrices


# ------------------------------------------------------------------ Megatron-LM 2021: no sequence parallelism
def _megatron_2021(b: int = 2, s: int = 8, h: int = 32, heads: int = 4) -> dict:
    """One GPT layer and the final norm in Megatron-LM's 2021 layouts on dp=2 x tp=4: activations
    S(0) on dp and Replicate on tp, q/k/v/fc1 column-parallel, wo/fc2 row-parallel, the norms
    replicated.  No explicit all-reduce: the row-parallel outputs stay P(sum) on tp and the reshard
    pass places the reductions (the residual stream is a partial sum until a norm needs it whole)."""
    d = h // heads
    act, col, row, rep = ["S(0)", "R"], ["R", "S(0)"], ["R", "S(1)"], ["R", "R"]
    inputs = {"x": {"shape": [b, s, h], "placements": act}}
    for w, shape, pl in (("ln1_w", [h], rep), ("ln1_b", [h], rep), ("wq", [h, h], col), ("wk", [h, h], col),
                         ("wv", [h, h], col), ("wo", [h, h], row), ("ln2_w", [h], rep), ("ln2_b", [h], rep),
                         ("fc1", [4 * h, h], col), ("fc2", [h, 4 * h], row), ("lnf_w", [h], rep),
                         ("lnf_b", [h], rep)):
        inputs[w] = {"shape": shape, "placements": pl}
    nodes = []

    def node(name, op, args, **attrs):
        nodes.append({"name": name, "op": op, "inputs": args, "attrs": attrs})
        return name

    ln = node("ln1", "layer_norm", ["x", "ln1_w", "ln1_b"])
    qkv = []
    for n in "qkv":
        split = node(n + "_heads", "reshape", [node(n, "linear", [ln, "w" + n])], shape=[b, s, heads, d])
        qkv.append(node(n + "_bnsd", "transpose", [split], dims=[0, 2, 1, 3]))
    probs = node("probs", "softmax", [node("scores", "einsum", qkv[:2], equation="bnsd,bntd->bnst")], axis=-1)
    attn = node("attn", "einsum", [probs, qkv[2]], equation="bnst,bntd->bnsd")
    merged = node("merged", "reshape", [node("attn_bsnd", "transpose", [attn], dims=[0, 2, 1, 3])], shape=[b, s, h])
    res1 = node("res1", "add", ["x", node("proj", "linear", [merged, "wo"])])
    ln2 = node("ln2", "layer_norm", [res1, "ln2_w", "ln2_b"])
    up = node("gelu", "gelu", [node("fc1_out", "linear", [ln2, "fc1"])])
    out = node("out", "add", [res1, node("fc2_out", "linear", [up, "fc2"])])
    node("lnf", "layer_norm", [out, "lnf_w", "lnf_b"])
    return {"mesh": {"shape": [2, 4], "names": ["dp", "tp"]}, "inputs": inputs, "nodes": nodes, "outputs": ["lnf"]}


# Megatron-LM's collectives for that graph, per rank: an activation is [2, 8, 32] fp32 = 2048 bytes,
# 1024 a dp rank, whole on tp; its ring all-reduce over tp=4 sends 2 x 3/4 x 1024 = 1536.
AR_2021 = 2 * 3 * (2 * 8 * 32 * 4 // 2) // 4
FORWARD_2021 = 2 * AR_2021  # after wo and after fc2 (here: before ln2 and before lnf)
BACKWARD_2021 = 2 * AR_2021  # the input gradients of q/k/v and of fc1 (before the norms' backward)
# over dp=2, each rank's local shards: wq, wk, wv, wo 32 x 32 / 4 on tp, fc1, fc2 128 x 32 / 4, six norm vectors
DP_2021 = 4 * (32 * 32 * 4 // 4) + 2 * (128 * 32 * 4 // 4) + 6 * (32 * 4)


def test_megatron_2021_layouts_move_the_hand_count():
    assert (FORWARD_2021, BACKWARD_2021, DP_2021) == (3072, 3072, 13056)
    a = analyze(load_spec(_megatron_2021()), reshard=True, backward=True)
    assert a.ok
    assert a.check.total_bytes_per_rank == FORWARD_2021 + BACKWARD_2021 + DP_2021 == 19200
    steps = Counter((s.kind, s.mesh_axis_name) for r in a.check.redistributions for s in r.plan.steps
                    if s.bytes_per_rank)  # (x is made a free local partial for the first residual add)
    # no weight gathered on tp (the dx of a row-parallel linear reads the all-reduced cotangent), and
    # no norm weight gradient reduced over tp (each norm's backward reads a whole cotangent)
    assert steps == Counter({("all-reduce", "tp"): 4, ("all-reduce", "dp"): 12})


def test_megatron_2021_layouts_run_equal_to_one_device():
    rep = run_graph(load_spec(_megatron_2021()), backward=True, seed=1)
    assert rep.ok, rep.mismatches
    assert len(rep.grads) == 13
