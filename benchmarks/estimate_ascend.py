"""The step-time model against published Ascend 910B training throughput: predicted and published, side by side.

Published figures (tokens per second per NPU, MindFormers' unit ``tokens/s/p``), each with its
configuration as MindFormers publishes it for an Atlas 800T A2 node (8 Ascend 910B NPUs):

- Llama 2 7B, sequence 4096: 4,820 (pretrain, the model card ``docs/model_cards/llama2.md`` of
  mindspore-lab/mindformers, "performance measured on Atlas 800T A2"), 4,160 (the "training
  performance" column of MindFormers r1.3 docs, start/models, "Configuration Atlas 800T A2") and
  4,100 (the model card's Atlas 900 A2 PoDc table).  Configuration
  ``configs/llama2/pretrain_llama2_7b.yaml``: data_parallel 8, model_parallel 1, pipeline_stage 1,
  batch_size 1, gradient_accumulation_steps 8, float16, flash attention, no recomputation,
  ``enable_parallel_optimizer`` (optimizer states sharded over the data-parallel ranks: ZeRO-1
  here); hidden 4096, 32 layers, 32 heads, FFN 11008, vocabulary 32,000.
- Llama 3 8B, sequence 8192: 2,581 (MindFormers r1.3 docs, start/models, "Configuration Atlas 800T
  A2").  Configuration ``research/llama3/finetune_llama3_8b_8k_800T_A2_64G.yaml``: data_parallel
  8, model_parallel 1, pipeline_stage 1, batch_size 1, no accumulation, bfloat16, flash attention,
  full recomputation, parallel optimizer; hidden 4096, 32 layers, 32 heads, 8 key/value heads,
  FFN 14336, vocabulary 128,256.

Each row's graph is ``gen llama --full`` in those sizes on a mesh dp=8 (x sp=1 x tp=1), one
micro-batch of one sequence per NPU, estimated on the ``ascend-910b`` profile with the row's
recomputation, ZeRO-1 and global batch (``layout_prop.perf.step.estimate_step``, as ``layout-prop
estimate`` does).  The predicted figure is global batch x sequence / modelled step time / 8.

What the published runs do that the graph does not say: the embedding and output head are not
tied (as the graph), MindFormers' fused flash attention and RMSNorm kernels, graph-mode operator
fusion, its own overlap of communication; which MindFormers and CANN versions measured each
figure is not stated beside it (the three 7B figures differ by up to 18%).  The ``ascend-910b``
profile's figures are mostly assumed (``layout_prop/perf/clusters.py`` says which); nothing here
is fitted, and no profile figure was changed to fit these rows.

    python benchmarks/estimate_ascend.py [--layers N]

``--layers N`` caps every model at N layers (quick; the figures are then not the published
configuration's, and the table says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from layout_prop.api import analyze
from layout_prop.frontends.generate import llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.passes.zero import Zero, finish, parse_zero
from layout_prop.perf.clusters import get_cluster
from layout_prop.perf.step import estimate_step

MODEL_CARD = "mindspore-lab/mindformers docs/model_cards/llama2.md, Atlas 800T A2 table"
PODC = "mindspore-lab/mindformers docs/model_cards/llama2.md, Atlas 900 A2 PoDc table"
MODELS_PAGE = "MindFormers r1.3 docs, start/models (mindspore.cn), 'Configuration Atlas 800T A2'"


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    seq: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype: str
    recompute: str
    global_batch: int
    config: str
    published: tuple[tuple[float, str], ...]  # (tokens/s per NPU, source)


DP = 8  # one Atlas 800T A2 node, data parallelism only, in both configurations
ROWS = [
    Row("Llama 2 7B", 4096, 4096, 32, 32, 32, 11008, 32_000, "float16", "none", DP * 1 * 8,
        "configs/llama2/pretrain_llama2_7b.yaml",
        ((4820, MODEL_CARD), (4160, MODELS_PAGE), (4100, PODC))),
    Row("Llama 3 8B", 8192, 4096, 32, 32, 8, 14336, 128_256, "bfloat16", "full", DP * 1,
        "research/llama3/finetune_llama3_8b_8k_800T_A2_64G.yaml",
        ((2581, MODELS_PAGE),)),
]


def predict(row: Row, cluster, layers: int):
    """Tokens per second per NPU the model predicts for ``row`` (and the estimate)."""
    spec = llama_spec(layers, mesh=(("dp", DP), ("sp", 1), ("tp", 1)), batch=DP, seq=row.seq, hidden=row.hidden,
                      heads=row.heads, kv_heads=row.kv_heads, ffn=row.ffn, dtype=row.dtype, full=True,
                      vocab=row.vocab)
    graph = load_spec(spec)
    zero = parse_zero(1, graph.mesh)
    analysis = analyze(Zero(zero).run(graph), reshard=True, backward=True)
    if not analysis.ok:
        raise SystemExit(f"{row.name}: the graph does not check: {analysis.check.violations[0]}")
    est = estimate_step(finish(analysis.graph, zero), cluster, global_batch=row.global_batch, micro_batch=1,
                        recompute=row.recompute, zero=zero)
    return row.global_batch * row.seq / est.step_time_s / DP, est


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="cap every model at this many layers (quick)")
    args = parser.parse_args()
    cluster = get_cluster("ascend-910b")
    print(f"cluster ascend-910b ({cluster.device}): peak {cluster.peak_tflops['float16']:g} TFLOP/s fp16, "
          f"matrix efficiency {cluster.matmul_efficiency:g} (the A100 fit, not an Ascend one), HBM "
          f"{cluster.hbm_GBps:g} GB/s; nothing fitted here"
          + (f"; models capped at {args.layers} layers (not the published configuration)" if args.layers else ""))
    print(f"{'model':>11} {'seq':>5} {'dp':>3} {'batch':>5} {'recompute':>9} {'predicted':>9} {'published':>9} "
          f"{'error':>7}  {'step s':>7} {'compute':>8} {'comm':>6} {'optim':>6} {'mem GiB':>7} {'model s':>7}  source")
    errors = []
    for row in ROWS:
        layers = min(row.layers, args.layers or row.layers)
        start = time.perf_counter()
        tokens, est = predict(row, cluster, layers)
        took = time.perf_counter() - start
        for k, (published, source) in enumerate(row.published):
            error = tokens / published - 1
            errors.append(abs(error))
            head = (f"{row.name:>11} {row.seq:>5} {DP:>3} {row.global_batch:>5} {row.recompute:>9} {tokens:>9.0f}"
                    if k == 0 else f"{'':>11} {'':>5} {'':>3} {'':>5} {'':>9} {'':>9}")
            tail = (f"{est.step_time_s:>7.2f} {est.compute_s:>8.2f} {est.communication_s:>6.2f} "
                    f"{est.optimizer_s:>6.3f} {est.memory_per_rank_bytes / 2 ** 30:>7.1f} {took:>7.1f}"
                    if k == 0 else f"{'':>7} {'':>8} {'':>6} {'':>6} {'':>7} {'':>7}")
            print(f"{head} {published:>9.0f} {error:>+7.1%}  {tail}  {source}")
        print(f"{'':>11} configuration: {row.config}")
        if est.memory_per_rank_bytes > cluster.hbm_bytes:
            print(f"{'':>11} note: the modelled memory, {est.memory_per_rank_bytes / 2 ** 30:.1f} GiB a rank, exceeds "
                  f"the profile's {cluster.hbm_gb:g} GB (the published run fits in 58 GB of device memory)")
    print(f"largest error: {max(errors):.1%} (issue #30's target on A100 rows: within 15%; no Ascend row is fitted)")


if __name__ == "__main__":
    main()
