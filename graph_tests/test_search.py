"""plan --search: the analytic formulas against the papers' figures, a small search consistent with
``estimate`` on the spec it writes, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from layout_prop.cli import main
from layout_prop.workflows.search import analysed, load_model_shape, run_search
from layout_prop.frontends.generate import gpt_spec
from layout_prop.io.loader import load_spec
from layout_prop.perf import parallel as par
from layout_prop.perf.clusters import get_cluster
from layout_prop.perf.step import estimate_step
from layout_prop.planner.search import Config, InfeasibleSearch, LayerCache, evaluate

GB = 1e9


def test_pipeline_bubble_is_narayanan_et_al():
    # SC'21 section 2.2: (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved
    assert par.bubble_fraction(8, 32, "gpipe") == par.bubble_fraction(8, 32, "1f1b") == 7 / 32
    assert par.bubble_fraction(8, 32, "interleaved", 4) == 7 / 128
    assert par.bubble_fraction(1, 5, "1f1b") == 0
    # the step: m t_stage plus (p - 1) stage times, (p - 1) / v interleaved
    assert par.pipeline_time(2.0, 4, 16, "1f1b") == pytest.approx(2.0 * (16 + 3))
    assert par.pipeline_time(2.0, 4, 16, "interleaved", 3) == pytest.approx(2.0 * (16 + 1))


def test_in_flight_micro_batches_per_schedule():
    assert par.inflight_microbatches(8, 64, "gpipe") == 64
    assert par.inflight_microbatches(8, 64, "1f1b") == 8
    assert par.inflight_microbatches(8, 4, "1f1b") == 4
    # Korthikanti et al. 4.2.3: p (1 + (p - 1) / (p v)) for interleaved 1F1B
    assert par.inflight_microbatches(4, 64, "interleaved", 2) == pytest.approx(4 * (1 + 3 / 8))


def test_activation_bytes_are_korthikanti_et_al():
    # GPT-3 175B (s 2048, h 12288, a 96), one sequence, tensor parallel 8, by hand from equations 1-6
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h  # 25,165,824
    assert par.activation_bytes_per_layer(s, b, h, a) == sbh * 34 + 5 * a * s * s * b  # 2,868,903,936
    assert par.activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=False) == pytest.approx(
        sbh * (10 + 24 / 8) + 5 * a * s * s * b / 8)
    assert par.activation_bytes_per_layer(s, b, h, a, t) == pytest.approx(2_868_903_936 / 8)
    assert par.activation_bytes_per_layer(s, b, h, a, t, recompute="selective") == 34 * sbh / 8
    assert par.activation_bytes_per_layer(s, b, h, a, t, recompute="full") == 2 * sbh / 8


def test_zero_memory_is_rajbhandari_et_al_figure_1():
    # 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    figures = [par.zero_model_state_bytes(7.5e9, stage, 64) / GB for stage in range(4)]
    assert figures == pytest.approx([120.0, 31.4, 16.6, 1.875], abs=0.05)
    assert par.zero_communication_bytes(10, 1) == 20 and par.zero_communication_bytes(10, 3) == 30


def test_gradient_sync_prices_the_zero_collectives():
    a100 = get_cluster("a100-80g")
    shape = (16, 8)  # dp across two nodes, tp inside
    nbytes = 64e6
    zero0 = par.grad_sync_time(nbytes, 0, shape, 0, a100)
    zero3 = par.grad_sync_time(nbytes, 3, shape, 0, a100)
    assert zero0 > 0 and zero3 == pytest.approx(1.5 * zero0, rel=0.05)  # 3 psi against 2 psi
    assert par.grad_sync_time(nbytes, 0, (1, 8), 0, a100) == 0


GPT = dict(layers=4, mesh=(("dp", 2), ("sp", 1), ("tp", 2)), batch=4, seq=256, hidden=512, heads=8, vocab=1024,
           dtype="float16")


@pytest.fixture(scope="module")
def gpt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("search") / "gpt.yaml"
    path.write_text(json.dumps(gpt_spec(**GPT)))
    return path


def _cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_small_search_is_feasible_and_agrees_with_estimate(gpt_file, tmp_path, capsys):
    out_spec, plan = tmp_path / "best.yaml", tmp_path / "plan.yaml"
    code, out, err = _cli(["plan", str(gpt_file), "--search", "--cluster", "a100-80g", "--devices", "16",
                           "--global-batch", "64", "--axes", "pp=1", "--top", "40", "--json", "-o", str(out_spec),
                           "--plan-out", str(plan)], capsys)
    assert code == 0, err
    data = json.loads(out)
    top = data["top"]
    assert data["candidates"] >= len(top) > 2 and data["layer_evaluations"] > 0
    best = top[0]
    assert best["memory_per_rank_bytes"] <= data["memory_limit"]
    assert [t["step_time_s"] for t in top] == sorted(t["step_time_s"] for t in top)
    # estimate on the written spec, with the same batch, micro-batch and recomputation
    config = best["config"]
    code, est_out, err = _cli(["estimate", str(out_spec), "--cluster", "a100-80g", "--global-batch", "64",
                               "--micro-batch", str(config["micro_batch"]), "--recompute",
                               "full" if config["recompute"] == "full" else "none", "--json"], capsys)
    assert code == 0, err
    measured = json.loads(est_out)["step_time_s"]
    assert best["step_time_s"] == pytest.approx(measured, rel=0.05)
    assert "parameters:" in plan.read_text() and "micro_batch" in plan.read_text()
    # the ranking agrees with estimate on two clearly different configurations
    slow = next(t for t in top if t["step_time_s"] > 1.3 * best["step_time_s"] and t["config"]["recompute"] == "none")
    model = load_model_shape(load_spec(gpt_file))
    times = []
    for entry in (best, slow):
        c = entry["config"]
        graph = analysed(model.spec(model.layers, c["tp"], c["cp"], c["ep"], c["dp"], c["micro_batch"]))
        times.append(estimate_step(graph, get_cluster("a100-80g"), global_batch=64, micro_batch=c["micro_batch"],
                                   recompute="full" if c["recompute"] == "full" else "none").step_time_s)
    assert times[0] < times[1]
    assert slow["step_time_s"] == pytest.approx(times[1], rel=0.1)


def test_pipelined_candidate_adds_the_bubble_and_the_moves_it_should(gpt_file):
    """dp=4 x tp=2 x pp=2 1F1B on 16 a100s, 16 micro-batches of one sequence.  The bubble is one stage's
    micro-batch (p - 1 = 1); the moves on the critical path are 16 + 2 - 2 - ceil(15 / 2) = 8 each way
    (test_pipeline_makespan.py), each across nodes (pp outermost, 8 ranks a stage = a node): the layer's input
    (1 x 256 x 512 float16 = 262,144 bytes) at 25 GB/s x 0.8 + 6 us = 19.1072 us forward, once back (the
    norm's and the residual add's gradient terms summed before the send), and the tied embedding's gradient
    (1024 x 512 x 2 / tp 2 = 524,288 bytes: 32.2144 us) once a step, before the last task (the program sends the
    last stage's sum over the micro-batches once; it was priced, and sent, with every backward move: 8 times)."""
    cluster = get_cluster("a100-80g")
    model = load_model_shape(load_spec(gpt_file))
    cache = LayerCache(model, cluster, analysed)
    flat = evaluate(Config(dp=8, tp=2, pp=1), model, cluster, 64, cache)
    piped = evaluate(Config(dp=4, tp=2, pp=2, schedule="1f1b"), model, cluster, 64, cache)
    m = piped.parts["micro_batches"]
    assert m == 16 and piped.parts["layers_per_stage"] == 2
    stage = (piped.parts["compute_s"] + piped.parts["recompute_s"] + piped.parts["comm_s"]) / m
    assert piped.parts["bubble_s"] == pytest.approx(stage * (2 - 1))
    move, tied = 262_144 / (25e9 * 0.8) + 6e-6, 524_288 / (25e9 * 0.8) + 6e-6
    assert piped.parts["p2p_s"] == pytest.approx(8 * (move + move) + tied)
    assert piped.step_time_s == pytest.approx(m * stage + piped.parts["bubble_s"] + piped.parts["p2p_s"]
                                              + piped.parts["accumulate_s"] + piped.parts["grad_sync_exposed_s"]
                                              + piped.parts["optimizer_s"])
    # the 16 micro-batches' weight gradients summed: 15 adds of the larger stage's gradients (its two layers and
    # the embedding or the final norm and head it holds), each add three times their bytes through HBM (2,039 GB/s
    # x 0.8)
    from layout_prop.planner.search import _rest_on_stage

    layer, rest, _ = cache.get(2, 1, 1, 1)
    grads = 2 * layer.param_bytes + max(_rest_on_stage(rest, "param_bytes", True, False),
                                        _rest_on_stage(rest, "param_bytes", False, True))
    assert grads > 0 and piped.parts["accumulate_s"] == pytest.approx(15 * 3 * grads / (2039e9 * 0.8), rel=1e-9)
    assert piped.memory_bytes < flat.memory_bytes  # half the layers' states a rank


def test_why_gives_a_sub_millisecond_difference_in_microseconds(gpt_file):
    """On a small model #1 and the next candidate with another step time differ by tens of microseconds; the line
    said '0.0 ms faster'.  (GPipe and 1F1B over as many micro-batches as stages take the same step: the first
    candidate that differs is compared.)"""
    from dataclasses import replace

    result = run_search(load_model_shape(load_spec(gpt_file)), get_cluster("a100-80g"), 16, 64, fixed={"pp": 2})
    first = result.ranked[0]
    second = next(c for c in result.ranked[1:] if c.step_time_s - first.step_time_s >= 5e-8)
    gap_us = (second.step_time_s - first.step_time_s) * 1e6
    assert 0 < gap_us < 1000
    why = replace(result, ranked=[first, second]).why()
    assert why.startswith(f"#1 is {gap_us:,.1f} us faster than #2"), why


def test_why_calls_a_difference_below_display_a_tie(capsys):
    """examples/llama_block.yaml (one layer, fused attention: selective recomputation recomputes nothing): #1 and
    #2 differ by float noise only; the line said '#1 is 0.0 us faster ... its recomputation is 0.0 us shorter'."""
    from pathlib import Path

    block = Path(__file__).resolve().parents[1] / "examples" / "llama_block.yaml"
    status, out, err = _cli(["plan", str(block), "--search", "--cluster", "a100-80g", "--devices", "8",
                             "--global-batch", "8", "--json"], capsys)
    assert status == 0, err
    result = json.loads(out)
    assert result["model"].startswith("llama, 1 layer (")
    first, second = result["top"][0], result["top"][1]
    if abs(second["step_time_s"] - first["step_time_s"]) < 5e-8:
        assert " tie on step time" in result["why"], result["why"]
    assert "0.0 us" not in result["why"] and "0.0 ms" not in result["why"], result["why"]


#: the units of plan --search's table: a figure and its unit back to seconds or bytes
_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _figure(text: str) -> float:
    number, unit = text.split()
    return float(number.replace(",", "")) * _UNITS[unit]


def test_a_toy_model_s_table_shows_its_memory_and_step_times(tmp_path, capsys):
    """The table printed every toy model's memory as '0.00 GiB' and could round a step to '0.0 ms': each figure
    is now in the unit that shows it, and reads back as the JSON's value to its printed precision."""
    from layout_prop.frontends.generate import llama_spec

    path = tmp_path / "llama.yaml"
    path.write_text(json.dumps(llama_spec(layers=1, mesh=(("dp", 2), ("sp", 2), ("tp", 2)))))
    argv = ["plan", str(path), "--search", "--cluster", "a100-80g", "--devices", "8", "--global-batch", "16"]
    status, text, err = _cli(argv, capsys)
    assert status == 0, err
    status, out, err = _cli(argv + ["--json"], capsys)
    assert status == 0, err
    top = json.loads(out)["top"]
    rows = [line for line in text.splitlines() if line[:3].strip().isdigit() and "  dp=" in line]
    assert len(rows) == len(top) == 5
    for row, cand in zip(rows, top):
        step, memory = row[4:15], row[32:43]  # the step and memory columns (11 wide)
        assert "0.00 GiB" not in row and "0.0 ms" not in row, row
        assert _figure(step) == pytest.approx(cand["step_time_s"], rel=0.005), row
        assert _figure(memory) == pytest.approx(cand["memory_per_rank_bytes"], rel=0.005), row
        assert cand["memory_per_rank_bytes"] < 2**20 and cand["step_time_s"] < 1e-3  # (KiB and us: a toy)


def _result(*cands):
    """A SearchResult of the candidates ``(config, step seconds, memory bytes)``, ranked as given."""
    from layout_prop.planner.search import Candidate, ModelShape, SearchResult

    ranked = [Candidate(config=c, step_time_s=t, memory_bytes=m, tflops_per_device=0.0, mfu=0.0, parts={})
              for c, t, m in cands]
    model = ModelShape("gpt", 1, 64, 4, 256, 16, "float16")
    return SearchResult(model=model, cluster="a100-80g", devices=8, global_batch=8, memory_limit=2**30,
                        ranked=ranked, candidates=len(ranked), layer_evaluations=0, seconds=0.0)


def test_why_says_which_of_a_tie_needs_less_memory():
    """#1 and #2 tie on step time (1e-8 s apart) and #2 needs 5 KiB less: the line said they 'tie on step time and
    memory' (hidden by '0.00 against 0.00 GiB')."""
    a, b = Config(dp=8, tp=1, pp=1), Config(dp=4, tp=2, pp=1)
    result = _result((a, 2.0e-4, 103.5 * 1024), (b, 2.0e-4 + 1e-8, 98.5 * 1024))
    assert "tie on step time; #2 needs less memory (98.50 against 103.50 KiB per rank)" in result.why(), result.why()
    same = _result((a, 2.0e-4, 1024), (b, 2.0e-4, 1024))
    assert "tie on step time and memory" in same.why()


def test_candidates_within_the_model_error_are_a_tie_and_the_simplest_is_preferred(monkeypatch):
    """With a 10% model error, #2 (5% slower, data parallel only, more memory) and #3 (9% slower, tp=2, less
    memory) tie with #1 (tp=2, pp=2, ZeRO-1, full recomputation); #4 (11% slower) does not.  The search prefers
    the fewest moving parts (#2: none, against #1's four), and says so."""
    from layout_prop.perf import calibration

    monkeypatch.setattr(calibration, "CALIBRATION", calibration.Calibration(
        rows=3, mae=0.10, max_error=0.2, signed=0.0, measured="today", source="test"))
    first = Config(dp=2, tp=2, pp=2, zero=1, recompute="full")
    plain, tp2, slow = Config(dp=8, tp=1, pp=1), Config(dp=4, tp=2, pp=1), Config(dp=8, tp=1, pp=1, zero=2)
    result = _result((first, 1.0, 20 * 2**30), (plain, 1.05, 30 * 2**30), (tp2, 1.09, 10 * 2**30),
                     (slow, 1.11, 5 * 2**30))
    assert result.ties() == [0, 1, 2] and result.preferred() == 1
    text = result.uncertainty()
    assert text.startswith("within the model's error (mean 10% on 3 published runs) #1 ties with 2 other "
                           "candidates (up to #3); the search prefers #2 (dp=8 tp=1 pp=1"), text
    assert "fewer moving parts (0 against 4: data parallel only against tp=2, pp=2, zero=1, recompute=full)" in text
    assert "less memory" not in text and "50.0 ms slower in the model" in text, text
    # the first is preferred when nothing tied is simpler
    alone = _result((plain, 1.0, 2**30), (tp2, 1.05, 2**29))
    assert alone.preferred() == 0 and "the search prefers #1" in alone.uncertainty()
    assert _result((plain, 1.0, 2**30), (tp2, 1.2, 2**29)).uncertainty().endswith("no other candidate ties with #1")


def test_the_units_keep_a_large_model_s_form():
    """GiB from one GiB up and ms from one millisecond up, as the table and the why line printed them before."""
    from layout_prop.planner.search import _bytes_pair, format_bytes, format_seconds

    assert format_bytes(22.3 * 2**30) == "22.30 GiB" and format_bytes(2**40) == "1,024.00 GiB"
    assert format_seconds(31.13) == "31,130.0 ms" and format_seconds(0.0168) == "16.8 ms"
    assert _bytes_pair(2**30, 1.5 * 2**30) == "1.00 against 1.50 GiB"
    assert format_bytes(1023) == "1,023 bytes" and format_bytes(2**20 - 1) == "1.00 MiB"
    assert max(len(format_bytes(n)) for n in range(1000, 2**30, 9_999_991)) <= 11  # the table's column


@pytest.mark.parametrize("argv, code, words", [
    (["--cluster", "a100"], "unknown-cluster", "a100"),
    (["--global-batch", "63", "--axes", "dp=2"], "bad-batch", "63"),
    (["--axes", "tp=3"], "bad-devices", "tp=3"),
    (["--axes", "tp=2,tp=4"], "bad-axes", "tp=2 and tp=4"),  # searched tp=4 only, silently
    (["--memory-per-rank", "1MB"], "memory-infeasible", "least memory found is"),
    # a huge device count is refused at once (the divisors were enumerated up to N: it hung for minutes)
    (["--devices", str(10**20)], "bad-devices", "not a count in 1..16,777,216"),
    # no step's batch: 10^30 ranked steps of 10^25 ms, 10^400 was an internal error (float overflow)
    (["--global-batch", str(10**30)], "bad-batch", "more than 16,777,216 (2^24)"),
    (["--global-batch", str(10**400)], "bad-batch", "more than 16,777,216 (2^24)"),
])
def test_bad_requests_are_one_line(gpt_file, capsys, argv, code, words):
    base = {"--cluster": "a100-80g", "--devices": "16", "--global-batch": "64"}
    given = dict(zip(argv[::2], argv[1::2]))
    args = ["plan", str(gpt_file), "--search"] + [x for k, v in {**base, **given}.items() for x in (k, v)]
    status, out, err = _cli(args, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and code in lines[0] and words in lines[0], err


def test_infeasible_names_the_least_memory_configuration(gpt_file):
    model = load_model_shape(load_spec(gpt_file))
    with pytest.raises(InfeasibleSearch) as err:
        run_search(model, get_cluster("a100-80g"), 16, 64, memory_limit=1_000_000)
    assert err.value.code == "memory-infeasible" and err.value.least > 1_000_000
    assert err.value.config.devices == 16


def test_moe_dense_layers_are_a_second_shape_priced_once(tmp_path, capsys):
    spec = tmp_path / "moe.yaml"
    code, _, err = _cli(["gen", "moe", "--layers", "4", "--dense-layers", "1", "--dense-ffn", "64", "--full",
                         "--batch", "8", "--seq", "64", "--hidden", "64", "--heads", "4", "--experts", "8",
                         "--vocab", "128", "--dtype", "float16", "-o", str(spec)], capsys)
    assert code == 0, err
    model = load_model_shape(load_spec(spec))
    assert (model.family, model.layers, model.dense_layers, model.dense_ffn, model.distinct_layers) == \
        ("moe", 4, 1, 64, 2)
    cluster = get_cluster("a100-80g")
    cache = LayerCache(model, cluster, analysed)
    layer, rest, dense = cache.get(1, 1, 2, 1)
    assert cache.evaluations == 3  # one and two main layers, and one dense layer, once
    assert dense.param_bytes == 3 * 64 * 64 * 2 + 4 * 64 * 64 * 2 + 2 * 64 * 2  # SwiGLU, attention, two norms
    assert dense.param_bytes != layer.param_bytes and dense.flops > 0
    cand = evaluate(Config(dp=4, ep=2, tp=1, pp=2), model, cluster, 64, cache)
    assert cand.parts["layers_per_stage"] == 2 and cand.step_time_s > 0


def test_gen_moe_dense_layers_match_one_device(tmp_path, capsys):
    spec = tmp_path / "dense.yaml"
    assert _cli(["gen", "moe", "--layers", "2", "--dense-layers", "2", "--dense-ffn", "48", "--full", "-o",
                 str(spec)], capsys)[0] == 0
    code, out, err = _cli(["run", str(spec), "--backward"], capsys)
    assert code == 0 and "matches one device" in out, out + err


def test_the_written_pipelined_spec_runs_equal_to_one_device(tmp_path, capsys):
    model_file, best = tmp_path / "tiny.yaml", tmp_path / "best.yaml"
    model_file.write_text(json.dumps(gpt_spec(layers=4, mesh=(("dp", 2), ("sp", 1), ("tp", 2)), batch=4, seq=16,
                                              hidden=32, heads=4, vocab=64)))
    code, out, err = _cli(["plan", str(model_file), "--search", "--cluster", "a100-80g", "--devices", "8",
                           "--global-batch", "16", "--axes", "pp=2,tp=2", "-o", str(best)], capsys)
    assert code == 0, err
    spec = load_spec(best)
    assert spec.mesh.names[0] == "pp" and spec.mesh.shape[0] == 2 and spec.meta["pipeline"]["axis"] == "pp"
    code, out, err = _cli(["pipeline", str(best), "--run"], capsys)
    assert code == 0 and "matches one device" in out, out + err


@pytest.mark.parametrize("kind, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 4, 1),
                                           ("interleaved", 4, 8, 2), ("interleaved", 8, 32, 2),
                                           ("interleaved", 4, 16, 4)])
def test_closed_forms_agree_with_the_executed_schedules(kind, p, m, v):
    """The search's formulas against passes/schedule.py's task orders (the pipeline pass's schedules): the
    in-flight peak of the first stage (theirs counts chunk micro-batches: over v) and the simulated bubble."""
    from layout_prop.passes import schedule as executed

    orders = executed.schedule(kind, p, m, v)
    assert max(executed.in_flight(orders)) / v == pytest.approx(par.inflight_microbatches(p, m, kind, v))
    timeline = executed.simulate(orders, p, v, t_forward=1.0, t_backward=2.0)
    assert timeline.bubble == pytest.approx(par.bubble_fraction(p, m, kind, v))


def test_a_pre_norm_block_reads_its_input_twice():
    """The pipelined program sends a stage input's gradient as one message a reader: a gen gpt or llama layer's
    input is read by its first norm (through a redistribute on tp) and by the residual add: 2."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.planner.search import boundary_readers

    mesh = (("dp", 1), ("sp", 1), ("tp", 2))
    assert boundary_readers(analysed(gpt_spec(2, mesh, batch=1, seq=64, hidden=64, heads=4, vocab=128,
                                              dtype="float16"))) == 2
    assert boundary_readers(analysed(llama_spec(2, mesh, batch=1, full=True))) == 2
