"""The step model against published training runs: predicted and published throughput a device, the error,
the memory per rank and whether it fits, and (``--rank``) where the published configuration ranks in the search.

The calibration set, each row with its source:

- Megatron-LM: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC'21 (arXiv:2104.04473), Table 1 (weak scaling, GPT 1.7B to 1T on DGX A100
  80GB nodes of Selene), every row: the model's heads, hidden size and layers, the tensor and
  pipeline degrees, the GPUs, the global batch and the achieved teraFLOP/s per GPU
  (``benchmarks/estimate_megatron.py`` ROWS).  Sequence 2048, vocabulary 51,200, fp16, full
  activation recomputation (section 5.1).  The published figure counts their equation 3,
  ``F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)`` FLOPs a step, over the measured step time; the
  predicted figure divides the same F by the modelled step time, so the two compare times.  Table 1
  does not give the micro-batch size or the schedule: micro-batch 1, and the better of 1F1B and the
  interleaved schedule where the layers divide (as ``benchmarks/search_published.py``).  The layer is
  Megatron-LM's 2021 layout (``estimate_megatron.gpt_spec``: no sequence parallelism, unfused
  attention, dropout 0.1 on the attention probabilities and before each residual add), and the
  data-parallel gradient all-reduce runs after the backward, not overlapped with it (Megatron-LM's
  local DDP of 2021 called ``allreduce_gradients`` after the last micro-batch's backward).
- MindFormers on Ascend 910B (one Atlas 800T A2 node, 8 NPUs): Llama 2 7B (three published
  figures) and Llama 3 8B, tokens per second per NPU, their configurations
  (``benchmarks/estimate_ascend.py`` ROWS, which give each figure's page): data parallel 8, ZeRO-1
  (MindFormers' parallel optimizer), no recomputation (7B) or full (8B).  The error is the one of
  tokens/s, which compares times as TFLOP/s would.

Every row is priced by the search's composition (``layout_prop.planner.search.evaluate`` on the
published configuration: the step model on one and two layers, composed over the pipeline, data
parallelism and ZeRO); memory per rank is its figure against the device's capacity.

    python benchmarks/published.py [--only megatron|ascend] [--rank] [--rows 1.7B,7.5B]

``--rank`` runs ``plan --search`` on each row (minutes on the large rows) and prints the published
configuration's place among the feasible candidates; ``--estimate`` runs ``layout-prop estimate`` (no
batch flags) on the spec ``plan --search -o`` would write for the row's configuration and prints its
step against the search's and how long it took.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import estimate_ascend  # noqa: E402
import estimate_megatron  # noqa: E402
from search_published import megatron_model, published_configs  # noqa: E402

from layout_prop.workflows.search import analysed, generator_spec, run_search  # noqa: E402
from layout_prop.perf.clusters import get_cluster  # noqa: E402
from layout_prop.planner.search import (PART_NAMES, Config, LayerCache, ModelShape, evaluate,  # noqa: E402
                                        widest_part)

MEGATRON = "Narayanan et al. SC'21 (arXiv:2104.04473) Table 1"


@dataclasses.dataclass(frozen=True)
class Published:
    """One published run: what it trained, how, and what it measured."""

    name: str
    source: str  # paper/table/row or page
    cluster: str
    model: ModelShape
    configs: tuple[Config, ...]  # the published configuration (several where the publication leaves a choice)
    global_batch: int
    published: float  # in ``unit``
    unit: str  # "TFLOP/s" (per device) or "tokens/s" (per device)
    work: float  # FLOPs a step in the publication's formula (TFLOP/s) or tokens a step (tokens/s)


@dataclasses.dataclass(frozen=True)
class Result:
    row: Published
    predicted: float
    config: Config
    step_s: float
    memory_bytes: float
    fits: bool
    seconds: float
    estimate: str = ""  # with --estimate: estimate of the spec -o would write, its step against the search's
    rank: str = ""
    first: str = ""  # with --rank: the search's first and how far the published configuration is from it

    @property
    def error(self) -> float:
        return self.predicted / self.row.published - 1


def megatron_rows() -> list[Published]:
    rows = []
    for i, r in enumerate(estimate_megatron.ROWS):
        rows.append(Published(
            name=f"GPT {r.name}", source=f"{MEGATRON} row {i + 1}", cluster="a100-80g", model=megatron_model(r),
            configs=tuple(dataclasses.replace(c, overlap_grad_reduce=False) for c in published_configs(r)),
            global_batch=r.batch, published=r.tflops, unit="TFLOP/s",
            work=estimate_megatron.megatron_flops(r.batch, r.layers, r.hidden)))
    return rows


def ascend_rows() -> list[Published]:
    rows = []
    for r in estimate_ascend.ROWS:
        model = ModelShape(family="llama", layers=r.layers, hidden=r.hidden, heads=r.heads, kv_heads=r.kv_heads,
                           ffn=r.ffn, seq=r.seq, dtype=r.dtype, vocab=r.vocab, full=True, tie=False,
                           builder=generator_spec)
        config = Config(dp=estimate_ascend.DP, tp=1, pp=1, zero=1, recompute=r.recompute, micro_batch=1)
        for value, source in r.published:
            rows.append(Published(
                name=r.name, source=f"{source} ({r.config})", cluster="ascend-910b", model=model, configs=(config,),
                global_batch=r.global_batch, published=value, unit="tokens/s", work=r.global_batch * r.seq))
    return rows


def estimate_written(row: Published, candidate, cluster) -> str:
    """``layout-prop estimate`` (no batch flags: the spec's training: block) of the spec ``plan --search -o`` writes
    for the row's priced configuration: its step against the search's, and the seconds it took."""
    import io
    import json
    import tempfile
    from contextlib import redirect_stdout

    from layout_prop.cli import main as cli
    from layout_prop.workflows.search import best_spec
    from layout_prop.planner.search import SearchResult

    result = SearchResult(model=row.model, cluster=cluster.name, devices=candidate.config.devices,
                          global_batch=row.global_batch, memory_limit=cluster.hbm_bytes, ranked=[candidate],
                          candidates=1, layer_evaluations=0, seconds=0.0)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "spec.json"
        path.write_text(json.dumps(best_spec(result)))
        args = ["estimate", str(path), "--cluster", cluster.name, "--json"]
        if not candidate.config.overlap_grad_reduce:
            args.append("--no-overlap")
        out = io.StringIO()
        start = time.perf_counter()
        with redirect_stdout(out):
            code = cli(args)
        took = time.perf_counter() - start
    if code != 0:
        return f"estimate: exit {code} ({took:.1f} s)"
    step = json.loads(out.getvalue())["step_time_s"]
    return f"estimate of the written spec: {step:.2f} s, {step / candidate.step_time_s - 1:+.1%} against the search, " \
           f"in {took:.1f} s"


def price(row: Published, caches: dict, rank: bool, estimate: bool = False) -> Result:
    cluster = get_cluster(row.cluster)
    start = time.perf_counter()
    key = (row.model, row.cluster)
    if key not in caches:
        caches[key] = LayerCache(row.model, cluster, analysed)
    priced = [evaluate(c, row.model, cluster, row.global_batch, caches[key]) for c in row.configs]
    best = min(priced, key=lambda c: c.step_time_s)
    devices = best.config.devices
    predicted = row.work / best.step_time_s / devices / (1e12 if row.unit == "TFLOP/s" else 1)
    place, first = "", ""
    if rank:
        fixed = {"cp": 1, "ep": 1}
        result = run_search(row.model, cluster, devices, row.global_batch, fixed=fixed)
        mine = {dataclasses.replace(p.config, overlap_grad_reduce=True) for p in priced}  # (the search's overlap)
        found = next((i + 1 for i, c in enumerate(result.ranked) if c.config in mine), None)
        place = f"{found}/{len(result.ranked)}" if found else f"-/{len(result.ranked)}"
        top = result.ranked[0]
        mine = result.ranked[found - 1] if found else best
        key, gap = widest_part(top, mine)
        first = (f"the search's first: {label(top.config)}, {top.step_time_s:.2f} s; the published configuration "
                 f"{mine.step_time_s / top.step_time_s - 1:+.1%} slower in the model"
                 + (f", most of it {PART_NAMES.get(key, key)} ({gap:+.2f} s)" if mine is not top else "")
                 + f"; {result.uncertainty()}")
    seconds = time.perf_counter() - start
    return Result(row=row, predicted=predicted, config=best.config, step_s=best.step_time_s,
                  memory_bytes=best.memory_bytes, fits=best.memory_bytes <= cluster.hbm_bytes,
                  seconds=seconds, rank=place, first=first,
                  estimate=estimate_written(row, best, cluster) if estimate else "")


def label(c: Config) -> str:
    sched = "" if c.pp == 1 else (f" i{c.v}" if c.schedule == "interleaved" else " 1f1b")
    return f"t{c.tp} p{c.pp} d{c.dp} z{c.zero} mb{c.micro_batch} {c.recompute}{sched}"


def summary(results: list[Result]) -> dict[str, float]:
    errors = [r.error for r in results]
    return {"rows": len(errors), "mae": sum(abs(e) for e in errors) / len(errors), "max": max(abs(e) for e in errors),
            "signed": sum(errors) / len(errors), "fit": sum(r.fits for r in results)}


def table(results: list[Result], rank: bool) -> str:
    lines = [f"{'run':<13} {'cluster':<11} {'configuration':<30} {'batch':>5} {'unit':>8} {'published':>9} "
             f"{'predicted':>9} {'error':>7} {'step s':>8} {'mem GiB':>7} {'fits':>4}"
             + (f" {'rank':>9}" if rank else "") + f" {'s':>5}  source"]
    for r in results:
        lines.append(f"{r.row.name:<13} {r.row.cluster:<11} {label(r.config):<30} {r.row.global_batch:>5} "
                     f"{r.row.unit:>8} {r.row.published:>9.0f} {r.predicted:>9.1f} {r.error:>+7.1%} "
                     f"{r.step_s:>8.2f} {r.memory_bytes / 2 ** 30:>7.1f} {'yes' if r.fits else 'NO':>4}"
                     + (f" {r.rank:>9}" if rank else "") + f" {r.seconds:>5.1f}  {r.row.source}")
        if r.first:
            lines.append(f"{'':>13} {r.first}")
        if r.estimate:
            lines.append(f"{'':>13} {r.estimate}")
    s = summary(results)
    lines.append(f"{s['rows']} rows: mean absolute error {s['mae']:.1%}, max {s['max']:.1%}, mean signed error "
                 f"{s['signed']:+.1%}; {s['fit']} of {s['rows']} fit their device in the model")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["megatron", "ascend"], default=None)
    parser.add_argument("--rank", action="store_true", help="run the search on each row (slow on the large rows)")
    parser.add_argument("--estimate", action="store_true", help="also run estimate on the spec plan --search -o "
                        "writes for each row's configuration (its step against the search's, and its time)")
    parser.add_argument("--rows", default=None, help="comma-separated row names (e.g. 'GPT 1.7B,Llama 2 7B')")
    args = parser.parse_args()
    rows = []
    if args.only in (None, "megatron"):
        rows += megatron_rows()
    if args.only in (None, "ascend"):
        rows += ascend_rows()
    if args.rows:
        wanted = {w.strip() for w in args.rows.split(",")}
        rows = [r for r in rows if r.name in wanted or r.name.split()[-1] in wanted]
    caches: dict = {}
    results = [price(row, caches, args.rank, args.estimate) for row in rows]
    print(table(results, args.rank))
    for group in ("a100-80g", "ascend-910b"):
        part = [r for r in results if r.row.cluster == group]
        if part and len(part) < len(results):
            s = summary(part)
            print(f"  {group}: {s['rows']} rows, mean absolute error {s['mae']:.1%}, max {s['max']:.1%}, "
                  f"mean signed {s['signed']:+.1%}")


if __name__ == "__main__":
    main()
