"""``plan --search`` against published configurations (issue #31, "Validated against published configurations").

1. Megatron-LM's weak-scaling rows with pipeline parallelism: Narayanan et al., "Efficient
   Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21
   (arXiv:2104.04473), Table 1: GPT 145.6B on 1,536 A100 (t 8, p 8, batch 2304, 148
   teraFLOP/s per GPU), 529.6B on 2,520 (t 8, p 35, batch 2520, 163), 1008.0B on 3,072
   (t 8, p 64, batch 3072, 163); sequence 2048, vocabulary 51,200, fp16, full activation
   recomputation (the rows as ``benchmarks/estimate_megatron.py`` holds them).  Achieved
   teraFLOP/s there count ``F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)`` a step (their
   equation 3); the predicted figure divides the same F by the modelled step time.  The
   layer is Megatron-LM's 2021 layout (``estimate_megatron.gpt_spec``: tensor-parallel
   attention and MLP, no sequence parallelism, unfused attention).  Table 1 does not give
   the micro-batch size or the schedule: the published configuration is priced with
   micro-batch 1, no ZeRO (Megatron-LM 2021 had none), full recomputation, and both 1F1B
   and the interleaved schedule where the layers divide (the better is the row's figure).
2. hyper-parallel fast-tuner's DeepSeek-V3 671B example on 1,024 NPUs
   (``hyper_parallel/auto_parallel/fast-tuner/config/example/mindspore/pretrain_deepseek3_671b.yaml``
   in the shared snapshot: data_parallel 16 of which expert_parallel 8, model_parallel 4,
   pipeline_stage 16, micro_batch_num 32, batch_size 1, seq_length 4096, use_seq_parallel,
   enable_parallel_optimizer, recompute of 3-4 of each stage's 4 layers) on a
   DeepSeek-V3-shaped ``gen moe`` (61 layers, hidden 7168, 128 heads, 256 routed experts of
   ffn 2048, top-8, one shared expert, sigmoid router, vocabulary 129,280) on
   ``ascend-910b``.  Approximations: multi-head latent attention as plain multi-head
   attention (128 key/value heads, no low-rank projections); group-limited routing as plain
   top-8; capacity factor 1.0 per token group (each expert receives its balanced share
   ``T k / E`` of each expert-parallel rank's tokens: DeepSeek-V3 drops none and balances
   its loads without an auxiliary loss); the 3 first dense layers (SwiGLU, ffn 18432,
   ``gen moe --dense-layers 3 --dense-ffn 18432``) priced as their own shape; bfloat16 as
   float16 (same bytes); the parallel optimizer as ZeRO stage 1; the per-stage recompute as
   full recomputation; the schedule as 1F1B.  No step time is published for it: this
   compares the model with the model.

    python benchmarks/search_published.py [--only megatron|deepseek]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estimate_megatron import ROWS, Row, SEQ, VOCAB, gpt_spec, megatron_flops  # noqa: E402

from layout_prop.workflows.search import analysed, generator_spec, run_search  # noqa: E402
from layout_prop.perf.clusters import get_cluster  # noqa: E402
from layout_prop.planner.search import Config, LayerCache, ModelShape, evaluate  # noqa: E402

MEGATRON_SOURCE = "Narayanan et al., SC'21, arXiv:2104.04473, Table 1"
FAST_TUNER = ("hyper-parallel fast-tuner config/example/mindspore/pretrain_deepseek3_671b.yaml "
              "(dp 16 incl. ep 8, tp 4, pp 16, 32 micro-batches of 1, seq 4096)")


def megatron_builder(row: Row):
    def build(model, layers, tp, cp=1, ep=1, dp=1, micro_batch=1, dense=None):
        shaped = dataclasses.replace(row, tp=tp, pp=1, gpus=dp * tp)
        return gpt_spec(shaped, micro_batch, layers)
    return build


def megatron_model(row: Row) -> ModelShape:
    return ModelShape(family="gpt", layers=row.layers, hidden=row.hidden, heads=row.heads, ffn=4 * row.hidden,
                      seq=SEQ, dtype="float16", vocab=VOCAB, builder=megatron_builder(row))


def published_configs(row: Row) -> list[Config]:
    dp = row.gpus // (row.tp * row.pp)
    configs = [Config(dp=dp, tp=row.tp, pp=row.pp, recompute="full", schedule="1f1b")]
    per_stage = row.layers // row.pp
    for v in range(2, per_stage + 1):
        if row.layers % (row.pp * v) == 0 and (row.batch // dp) % row.pp == 0:
            configs.append(Config(dp=dp, tp=row.tp, pp=row.pp, recompute="full", schedule="interleaved", v=v))
            break
    return configs


def megatron(cluster) -> None:
    print(f"Megatron-LM, published: {MEGATRON_SOURCE}; cluster {cluster.name}, matrix efficiency "
          f"{cluster.matmul_efficiency} (the profile's, fitted on the 1.7B row by estimate_megatron.py)")
    print(f"{'model':>8} {'GPUs':>5} {'t':>2} {'p':>3} {'batch':>5} {'published':>9} {'predicted':>9} {'error':>7} "
          f"{'schedule':>15} | {'cands':>6} {'rank':>5} {'chosen':>50} {'TFLOP/s':>8} {'search s':>8}")
    for row in [r for r in ROWS if r.pp > 1 and r.name in ("145.6B", "529.6B", "1008.0B")]:
        model = megatron_model(row)
        start = time.perf_counter()
        result = run_search(model, cluster, row.gpus, row.batch, fixed={"cp": 1, "ep": 1}, keep_all=True)
        took = time.perf_counter() - start
        flops = megatron_flops(row.batch, row.layers, row.hidden)
        cache = LayerCache(model, cluster, analysed)
        priced = [evaluate(c, model, cluster, row.batch, cache) for c in published_configs(row)]
        best = min(priced, key=lambda c: c.step_time_s)
        tflops = flops / best.step_time_s / row.gpus / 1e12
        labels = [c.config for c in result.ranked]
        rank = next((i + 1 for i, c in enumerate(labels) if c in {p.config for p in priced}), None)
        fits = best.memory_bytes <= result.memory_limit
        chosen = result.ranked[0]
        sched = "interleaved v=%d" % best.config.v if best.config.schedule == "interleaved" else best.config.schedule
        chosen_label = (f"t{chosen.config.tp} p{chosen.config.pp} d{chosen.config.dp} z{chosen.config.zero} "
                        f"{chosen.config.recompute} {chosen.config.schedule}"
                        + (f"(v{chosen.config.v})" if chosen.config.schedule == "interleaved" else "")
                        + f" mb{chosen.config.micro_batch}")
        print(f"{row.name:>8} {row.gpus:>5} {row.tp:>2} {row.pp:>3} {row.batch:>5} {row.tflops:>9.0f} {tflops:>9.1f} "
              f"{tflops / row.tflops - 1:>+7.1%} {sched:>15} | {result.candidates:>6} "
              f"{(str(rank) if rank else ('over memory' if not fits else 'absent')):>5} {chosen_label:>50} "
              f"{flops / chosen.step_time_s / row.gpus / 1e12:>8.1f} {took:>8.1f}")
    print("rank: the best-priced published configuration's place among the search's feasible candidates (all "
          "searched configurations with cp=1, ep=1); chosen: the search's first, its TFLOP/s counted with the "
          "published F (equation 3, which assumes full recomputation)")


def deepseek(cluster) -> None:
    model = ModelShape(family="moe", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=2048, seq=4096,
                       dtype="float16", vocab=129_280, full=True, tie=False, experts=256, top_k=8, shared_experts=1,
                       router="sigmoid", capacity_factor=1.0, capacity_scope="group",
                       dense_layers=3, dense_ffn=18432, distinct_layers=2, builder=generator_spec)
    devices, batch = 1024, 16 * 32 * 1
    published = Config(dp=2, ep=8, tp=4, pp=16, zero=1, recompute="full", schedule="1f1b", micro_batch=1)
    start = time.perf_counter()
    result = run_search(model, cluster, devices, batch, fixed={"cp": 1}, keep_all=True)
    took = time.perf_counter() - start
    cache = LayerCache(model, cluster, analysed)
    theirs = evaluate(published, model, cluster, batch, cache)
    rank = next((i + 1 for i, c in enumerate(result.ranked) if c.config == published), None)
    best = result.ranked[0]
    print(f"\nDeepSeek-V3-shaped gen moe on {devices} {cluster.name}, global batch {batch}: {FAST_TUNER}")
    print(f"  fast-tuner's configuration: {published.label()}")
    print(f"    predicted step {theirs.step_time_s:,.2f} s, MFU {theirs.mfu:.1%}, memory per rank "
          f"{theirs.memory_bytes / 2**30:,.1f} GiB (limit {result.memory_limit / 2**30:,.1f}); rank "
          f"{rank if rank else ('over memory' if theirs.memory_bytes > result.memory_limit else 'absent')} of "
          f"{len(result.ranked):,} feasible ({result.candidates:,} searched, {took:.1f} s)")
    print(f"  the search's first: {best.config.label()}")
    print(f"    predicted step {best.step_time_s:,.2f} s, MFU {best.mfu:.1%}, memory per rank "
          f"{best.memory_bytes / 2**30:,.1f} GiB: {theirs.step_time_s / best.step_time_s:.2f}x faster in the model")
    print(f"  why: {result.why()}")
    print("  the step's parts (s), fast-tuner's / the search's first:")
    for part in sorted(p for p in set(theirs.parts) | set(best.parts) if p.endswith("_s")):
        print(f"    {part:<32} {theirs.parts.get(part, 0.0):>9.2f} {best.parts.get(part, 0.0):>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["megatron", "deepseek"], default=None)
    args = parser.parse_args()
    if args.only in (None, "megatron"):
        megatron(get_cluster("a100-80g"))
    if args.only in (None, "deepseek"):
        deepseek(get_cluster("ascend-910b"))


if __name__ == "__main__":
    main()
