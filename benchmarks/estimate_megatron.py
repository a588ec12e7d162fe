"""The step-time model against Megatron-LM's published runs: predicted and published, side by side.

Published: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473), Table 1, weak scaling of GPT models
on DGX A100 80GB nodes (Selene): sequence 2048, vocabulary 51,200, mixed precision (fp16),
full activation recomputation.  Achieved teraFLOP/s per GPU there counts
``F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)`` FLOPs a step (their equation 3, with
recomputation) over the measured step time; the predicted figure here divides the same F
by the modelled step time, so that the two columns compare times.

The model sees the rows it can express: those without pipeline parallelism (p = 1; the
configuration-search issue adds pipelines).  Each row's graph is a GPT in Megatron-LM's
2021 layout, written here (the tensor-parallel attention heads and MLP, no sequence
parallelism: the activations between blocks are replicated on ``tp`` and the row-parallel
outputs all-reduced right after their linear, as an explicit ``redistribute``;
vocab-parallel embedding and output layer tied to it; attention unfused, its scores
through HBM, as Megatron-LM computed it then, with its dropouts; no loss node: its FLOPs
are not in F either), one micro-batch of ``--micro-batch`` sequences per
data-parallel rank, analysed with its backward, and estimated with ``--recompute full``
on the ``a100-80g`` profile.

The profile's matrix efficiency is not a hardware figure: ``--fit ROW`` fits it so that
that row's prediction equals its published figure (bisection), and the other rows are
then predictions; the table gives the error of each and says which row was fitted.

    python benchmarks/estimate_megatron.py [--fit 1.7B] [--micro-batch 1] [--layers N]

``--layers N`` caps every model at N layers (a quick run; the figures are then not the
published configuration's, and the table says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from layout_prop.api import analyze
from layout_prop.io.loader import load_spec
from layout_prop.perf.clusters import get_cluster
from layout_prop.perf.step import estimate_step

SOURCE = "Narayanan et al., SC'21, arXiv:2104.04473, Table 1"
SEQ, VOCAB = 2048, 51_200


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU, published


ROWS = [
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def megatron_flops(batch: int, layers: int, hidden: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """Their equation: FLOPs of one step with full recomputation."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def gpt_spec(row: Row, micro_batch: int, layers: int, dtype: str = "float16", dropout: float = 0.1) -> dict:
    """A GPT in Megatron-LM's 2021 layout on mesh dp x tp (module docstring), with its dropouts (Megatron-LM's
    defaults ``--attention-dropout 0.1 --hidden-dropout 0.1``: on the attention probabilities and before each
    residual add; its fused bias-dropout-add kernel is priced as a dropout and an add)."""
    dp, tp = row.gpus // (row.tp * row.pp), row.tp
    h, heads, batch = row.hidden, row.heads, micro_batch * dp
    d = h // heads
    act, col, row_p, rep = ["S(0)", "R"], ["R", "S(0)"], ["R", "S(1)"], ["R", "R"]
    inputs = {
        "ids": {"shape": [batch, SEQ], "dtype": "int64", "placements": ["S(0)", "R"], "requires_grad": False},
        "emb": {"shape": [VOCAB, h], "dtype": dtype, "placements": col},
        "pos": {"shape": [SEQ, h], "dtype": dtype, "placements": rep},
        "lnf_w": {"shape": [h], "dtype": dtype, "placements": rep},
        "lnf_b": {"shape": [h], "dtype": dtype, "placements": rep},
    }
    nodes = []

    def node(name, op, args, **attrs):
        nodes.append({"name": name, "op": op, "inputs": args, "attrs": attrs})
        return name

    x = node("tok_ar", "redistribute", [node("tok", "embedding", ["ids", "emb"])], placements=act)
    x = node("x0", "add", [x, "pos"])
    for i in range(layers):
        p = f"l{i}_"
        for w, shape, pl in (("ln1_w", [h], rep), ("ln1_b", [h], rep), ("wq", [h, h], col), ("wk", [h, h], col),
                             ("wv", [h, h], col), ("wo", [h, h], row_p), ("ln2_w", [h], rep), ("ln2_b", [h], rep),
                             ("fc1", [4 * h, h], col), ("fc2", [h, 4 * h], row_p)):
            inputs[p + w] = {"shape": shape, "dtype": dtype, "placements": pl}
        ln = node(p + "ln1", "layer_norm", [x, p + "ln1_w", p + "ln1_b"])
        heads_bnsd = []
        for name in ("q", "k", "v"):
            lin = node(p + name, "linear", [ln, p + "w" + name])
            split = node(p + name + "_heads", "reshape", [lin], shape=[batch, SEQ, heads, d])
            heads_bnsd.append(node(p + name + "_bnsd", "transpose", [split], dims=[0, 2, 1, 3]))
        # unfused, as Megatron-LM ran in 2021: the scores go through HBM (its fused scale-mask-softmax kernel
        # reads and writes them once; the scale and the causal mask change no cost and are left out)
        q, k, v = heads_bnsd
        scores = node(p + "scores", "einsum", [q, k], equation="bnsd,bntd->bnst")
        probs = node(p + "probs", "softmax", [scores], axis=-1)
        if dropout:  # Megatron-LM's attention dropout on the probabilities (--attention-dropout 0.1)
            probs = node(p + "probs_drop", "dropout", [probs], p=dropout, seed=3 * i + 1)
        attn = node(p + "attn", "einsum", [probs, v], equation="bnst,bntd->bnsd")
        merged = node(p + "merged", "reshape", [node(p + "attn_bsnd", "transpose", [attn], dims=[0, 2, 1, 3])],
                      shape=[batch, SEQ, h])
        # the row-parallel outputs are all-reduced where Megatron-LM does it, right after the linear
        proj = node(p + "proj_ar", "redistribute", [node(p + "proj", "linear", [merged, p + "wo"])], placements=act)
        if dropout:  # the hidden dropout before each residual add (--hidden-dropout 0.1)
            proj = node(p + "proj_drop", "dropout", [proj], p=dropout, seed=3 * i + 2)
        x = node(p + "res1", "add", [x, proj])
        ln2 = node(p + "ln2", "layer_norm", [x, p + "ln2_w", p + "ln2_b"])
        up = node(p + "gelu", "gelu", [node(p + "fc1_out", "linear", [ln2, p + "fc1"])])
        down = node(p + "fc2_ar", "redistribute", [node(p + "fc2_out", "linear", [up, p + "fc2"])], placements=act)
        if dropout:
            down = node(p + "fc2_drop", "dropout", [down], p=dropout, seed=3 * i + 3)
        x = node(p + "out", "add", [x, down])
    final = node("lnf", "layer_norm", [x, "lnf_w", "lnf_b"])
    logits = node("logits", "linear", [final, "emb"])  # tied to the embedding table, vocab-parallel
    # the loss as Megatron-LM computed it in 2021: the fp16 logits cast to float32 (output.float(), its default
    # without --fp16-lm-cross-entropy), then its vocabulary-parallel cross entropy on them (the max and the per-token
    # parts on each rank's vocabulary slice, combined across tp: the logits never move)
    inputs["labels"] = {"shape": [batch, SEQ], "dtype": "int64", "placements": ["S(0)", "R"], "requires_grad": False}
    wide = node("logits_fp32", "cast", [logits], dtype="float32")
    top = node("logits_max", "max", [wide], dims=[-1])
    parts = node("loss_parts", "cross_entropy_parts", [wide, "labels", top])
    loss = node("loss", "cross_entropy_combine", [parts, top, "labels"], num_classes=VOCAB)
    for name in list(inputs):
        if name not in ("ids", "labels"):
            inputs[name].setdefault("requires_grad", True)
    return {"mesh": {"shape": [dp, tp], "names": ["dp", "tp"]}, "inputs": inputs, "nodes": nodes,
            "outputs": [loss]}


def predict(row: Row, cluster, micro_batch: int, layers: int) -> tuple[float, object]:
    analysis = analyze(load_spec(gpt_spec(row, micro_batch, layers)), reshard=True, backward=True)
    if not analysis.ok:
        raise SystemExit(f"{row.name}: the graph does not check: {analysis.check.violations[0]}")
    est = estimate_step(analysis.graph, cluster, global_batch=row.batch, micro_batch=micro_batch, recompute="full")
    return megatron_flops(row.batch, layers, row.hidden) / est.step_time_s / row.gpus / 1e12, est


def fit(row: Row, cluster, micro_batch: int, layers: int) -> float:
    """The matrix efficiency at which ``row``'s prediction equals its published figure (bisection)."""
    low, high = 0.05, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        tflops, _ = predict(row, dataclasses.replace(cluster, matmul_efficiency=mid), micro_batch, layers)
        low, high = (mid, high) if tflops < row.tflops else (low, mid)
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", default="1.7B", help="the row whose published figure fits the matrix efficiency "
                        "(default 1.7B); 'none' keeps the profile's")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences a micro-batch (default 1)")
    parser.add_argument("--layers", type=int, default=None, help="cap every model at this many layers (quick)")
    args = parser.parse_args()
    cluster = get_cluster("a100-80g")
    rows = [r for r in ROWS if r.pp == 1]
    layers_of = {r.name: min(r.layers, args.layers or r.layers) for r in rows}
    fitted = None
    if args.fit != "none":
        row = next(r for r in rows if r.name == args.fit)
        eff = fit(row, cluster, args.micro_batch, layers_of[row.name])
        cluster = dataclasses.replace(cluster, matmul_efficiency=eff)
        fitted = row.name
    print(f"published: {SOURCE}; cluster a100-80g, matrix efficiency {cluster.matmul_efficiency:.3f}"
          + (f" (fitted on {fitted})" if fitted else " (the profile's)")
          + (f"; models capped at {args.layers} layers (not the published configuration)" if args.layers else ""))
    print(f"{'model':>7} {'t':>2} {'d':>3} {'GPUs':>5} {'batch':>5} {'published':>9} {'predicted':>9} {'error':>7} "
          f"{'step s':>7} {'compute':>8} {'exposed comm':>12} {'model s':>7}")
    errors = []
    for row in rows:
        start = time.perf_counter()
        tflops, est = predict(row, cluster, args.micro_batch, layers_of[row.name])
        took = time.perf_counter() - start
        error = tflops / row.tflops - 1
        if row.name != fitted:
            errors.append(abs(error))
        print(f"{row.name:>7} {row.tp:>2} {row.gpus // row.tp:>3} {row.gpus:>5} {row.batch:>5} {row.tflops:>9.0f} "
              f"{tflops:>9.1f} {error:>+7.1%} {est.step_time_s:>7.2f} {est.compute_s:>8.2f} "
              f"{est.communication_s:>12.2f} {took:>7.2f}" + ("  (fitted)" if row.name == fitted else ""))
    skipped = [r.name for r in ROWS if r.pp > 1]
    print(f"rows with pipeline parallelism not modelled yet: {', '.join(skipped)}")
    if errors:
        print(f"largest error on the rows not fitted: {max(errors):.1%} (target: within 15%)")


if __name__ == "__main__":
    main()
