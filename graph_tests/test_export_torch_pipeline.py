"""The torch export of a pipelined plan, executed as training: ``gen llama --full`` on pp=2 x tp=2 with a
``pipeline:`` block, exported with ``export --to torch`` (torch.distributed.pipelining stages over the pp axis,
DTensor placements on tp inside each stage, the spec's schedule and micro-batches) and trained one step
(forward, loss, backward, SGD step) on 4 gloo processes on CPU, equals one process: the loss (the mean of the
micro-batches') and every parameter after the step. 1F1B, GPipe and interleaved 1F1B (2 virtual stages a rank).

torch is optional: skipped without it (``pip install -e '.[torch]'``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is optional: pip install -e '.[torch]'")
pytest.importorskip("torch.distributed.pipelining", reason="this torch has no torch.distributed.pipelining")

from layout_prop.commands.export import export_text  # noqa: E402
from layout_prop.core.errors import LayoutPropError  # noqa: E402
from layout_prop.frontends.generate import llama_spec  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402

WORLD = 4


def _spec(layers: int, schedule: str, micro_batches: int = 4, virtual_stages: int = 1, dp: int = 1,
          tp: int = 2, tie_embeddings: bool = False) -> dict:
    spec = llama_spec(layers=layers, mesh=(("pp", 2), ("dp", dp), ("sp", 1), ("tp", tp)), batch=4 * dp, seq=8,
                      hidden=32, heads=4, ffn=64, full=True, vocab=64, tie_embeddings=tie_embeddings)
    spec["pipeline"] = {"axis": "pp", "micro_batches": micro_batches, "schedule": schedule,
                        "virtual_stages": virtual_stages}
    return spec


def _export(spec: dict) -> str:
    _, code = export_text(load_spec(spec), "torch", source="llama.yaml")
    return code


def _train(tmp_path, spec: dict, code: str, world: int = WORLD, usage: str | None = None) -> dict:
    """The exported plan run on WORLD fresh gloo processes (forkserver: torch imported there once, no state of
    pytest's process inherited): the loss and every parameter after the step, gathered from the ranks' files."""
    import multiprocessing

    import torch.multiprocessing as mp

    from graph_tests.torch_gen_llama import pipeline_worker

    try:
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "graph_tests.torch_gen_llama"])
    except (ValueError, RuntimeError):
        pass
    out = tmp_path / "out"
    out.mkdir()
    args = (world, str(tmp_path / "store"), spec, code, str(out)) + ((usage,) if usage else ())
    mp.start_processes(pipeline_worker, args=args, nprocs=world, start_method="forkserver")
    saved = [torch.load(path) for path in sorted(out.glob("rank*.pt"))]
    params: dict = {}
    for one in saved:
        assert not set(params) & set(one["params"]), "a parameter held by two stages"
        params.update(one["params"])
    losses = [one["loss"] for one in saved if one["loss"] is not None]
    assert len(losses) == 1, losses
    return {"loss": losses[0], "params": params, "chunks": sorted(c for one in saved for c in one["chunks"])}


def _compare(result: dict, spec: dict, lr: float = 0.1) -> tuple[float, float]:
    """Assert the run equals one process (an SGD step of rate ``lr``); return (|loss error|, max parameter error)."""
    from graph_tests.torch_gen_llama import GenLlama, batch, one_step

    model = GenLlama(spec)
    loss = float(one_step(model, *batch(spec), lr=lr).detach())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert sorted(result["params"]) == sorted(params)
    worst = max(float((result["params"][n] - v).abs().max()) for n, v in params.items())
    for name, value in params.items():
        torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert abs(result["loss"] - loss) < 1e-5, (result["loss"], loss)
    print(f"loss {result['loss']:.7f} vs {loss:.7f} (error {abs(result['loss'] - loss):.1e}); "
          f"max parameter error {worst:.1e}")
    return abs(result["loss"] - loss), worst


def _worked_example() -> tuple[list[list[str]], list[str], str]:
    """docs/export.md's pipeline example: its two commands (argument lists), the lines of the excerpt of the
    written module shown under them (``...`` lines left out) and the lines that train a step with it."""
    import re
    import shlex
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "export.md").read_text()
    section = page[page.index("**Pipelines, executed.**"):]
    console = re.search(r"```console\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line[2:])[1:] for line in console.splitlines() if line.startswith("$ ")]
    excerpt, usage = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    return commands, [line for line in excerpt.splitlines() if line.strip() != "..."], usage


def test_the_worked_example_of_docs_export_trains_1f1b_equal_to_one_process(tmp_path, monkeypatch):
    """docs/export.md's pipeline example, run: gen and export as the page writes them, the excerpt's lines in the
    written module, and the page's lines training one 1F1B step on pp=2 x tp=2 with it, equal to one process."""
    import yaml

    from layout_prop.cli import main

    commands, excerpt, usage = _worked_example()
    assert [c[:1] for c in commands] == [["gen"], ["export"]], commands
    monkeypatch.chdir(tmp_path)
    for args in commands:
        assert main(args) == 0, args
    code = (tmp_path / "llama_pp.py").read_text()
    lines = code.splitlines()
    for line in excerpt:
        assert line in lines, line
    spec = yaml.safe_load((tmp_path / "llama_pp.yaml").read_text())
    result = _train(tmp_path, spec, code, usage=usage)  # the page's lines, MyChunk a torch module of the spec
    assert result["chunks"] == [0, 1]
    _compare(result, spec)


def test_interleaved_two_virtual_stages_step_equals_one_process(tmp_path):
    spec = _spec(layers=4, schedule="interleaved", virtual_stages=2)
    code = _export(spec)
    assert "SCHEDULE = 'ScheduleInterleaved1F1B'" in code.splitlines() and "VIRTUAL_STAGES = 2" in code.splitlines()
    result = _train(tmp_path, spec, code)
    assert result["chunks"] == [0, 1, 2, 3]
    _compare(result, spec)


def test_gpipe_with_recompute_step_equals_one_process(tmp_path):
    spec = _spec(layers=2, schedule="gpipe", micro_batches=2)
    spec["recompute"] = "full"
    code = _export(spec)
    assert "SCHEDULE = 'ScheduleGPipe'" in code.splitlines() and "RECOMPUTE = 'full'" in code.splitlines()
    _compare(_train(tmp_path, spec, code), spec)


@pytest.mark.parametrize("zero", [None, 3])
def test_1f1b_pp_dp_step_equals_one_process(tmp_path, zero):
    """pp=2 x dp=2 (tp of size 1 left out): each data-parallel rank cuts its half of the batch into the
    micro-batches; the parameters are DTensors replicated on dp (their gradients all-reduced there), or with
    ZeRO-3 plain tensors that fully_shard shards over dp (each stage module FSDP2's)."""
    spec = _spec(layers=2, schedule="1f1b", dp=2, tp=1)
    if zero:
        spec["zero"] = {"stage": zero}
    code = _export(spec)
    model_axes = "()" if zero else "('dp',)"
    assert "MESH_DIM_NAMES = ('pp', 'dp')" in code.splitlines() and f"MODEL_AXES = {model_axes}" in code.splitlines()
    assert "    'tokens': (Replicate(), Shard(0))," in code.splitlines()
    _compare(_train(tmp_path, spec, code), spec)


def test_a_summed_loss_is_not_scaled(tmp_path):
    """pipeline: {loss: sum}: the step's loss is the sum of the 4 micro-batches' means, so the gradients are not
    scaled (LOSS_MEAN = False: scale_grads off). The parameters after the step equal one process's on the batch
    mean with 4 times the learning rate (the sum's gradient is 4 times the mean's, the micro-batches equal)."""
    spec = _spec(layers=2, schedule="1f1b")
    spec["pipeline"]["loss"] = "sum"
    code = _export(spec)
    assert "LOSS_MEAN = False" in code.splitlines()
    result = _train(tmp_path, spec, code)
    _compare(result, spec, lr=0.4)


def test_zero3_tp_and_pp_on_eight_processes_step_equals_one_process(tmp_path):
    """pp=2 x dp=2 x tp=2 with zero: {stage: 3}, 8 processes: each stage's module fully_shard over dp, its
    parameters DTensors on tp (MODEL_AXES, a sub-mesh of one dim an axis), the boundaries on tp."""
    spec = _spec(layers=2, schedule="1f1b", dp=2, tp=2)
    spec["zero"] = {"stage": 3}
    code = _export(spec)
    for line in ("MESH_DIM_NAMES = ('pp', 'dp', 'tp')", "ZERO_AXES = ('dp',)", "MODEL_AXES = ('tp',)"):
        assert line in code.splitlines(), line
    _compare(_train(tmp_path, spec, code, world=8), spec)


@pytest.mark.parametrize("change, words", [
    ({"schedule": "1f1b", "micro_batches": 1}, "Schedule1F1B needs at least as many micro-batches as stages"),
    ({"tie_embeddings": True}, "the parameter {table!r} is read by chunks 0, 1 (a tied weight)"),
])
def test_what_torch_cannot_run_is_one_refusal(change, words, tmp_path, capsys):
    """A tied embedding would be two copies, each stage updating its own with its own gradient term: silently
    wrong, so refused, as a schedule torch refuses is."""
    change = dict(change)
    spec = _spec(layers=2, schedule="1f1b", dp=2, tie_embeddings=change.pop("tie_embeddings", False))
    spec["pipeline"].update(change)
    table = next(node["inputs"][1] for node in spec["nodes"] if node["op"] == "embedding")  # gen's name for it
    words = words.format(table=table)
    with pytest.raises(LayoutPropError) as err:
        _export(spec)
    assert err.value.code == "not-expressible" and words in err.value.message, err.value.message
    from layout_prop.cli import main
    from layout_prop.io.loader import format_spec

    path = tmp_path / "pp.yaml"
    path.write_text(format_spec(spec, None))
    capsys.readouterr()
    assert main(["export", str(path), "--to", "torch", "--input", "tokens", "--input", "labels"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "not-expressible" in err_lines[0] and "the pipeline: block (2 stages on pp, 1f1b" \
        in err_lines[0] and words in err_lines[0], err_lines


def test_a_model_input_the_pipeline_reads_whole_is_refused():
    """torch's schedule cuts every step argument into the micro-batches on dim 0; a model input the pipeline does
    not cut (here ``shift``, added to each micro-batch whole) would be cut all the same: refused, naming it (the
    plan's collected stage knows ``x`` is the batch the spec names)."""
    spec = {
        "mesh": {"shape": [2, 2], "names": ["pp", "tp"]},
        "inputs": {"x": {"shape": [4, 8]}, "shift": {"shape": [8]},
                   "w0": {"shape": [8, 8], "placements": ["R", "S(0)"]},
                   "w1": {"shape": [8, 8], "placements": ["R", "S(1)"]}},
        "nodes": [{"name": "l0_in", "op": "add", "inputs": ["x", "shift"]},
                  {"name": "l0_h", "op": "linear", "inputs": ["l0_in", "w0"]},
                  {"name": "l1_y", "op": "linear", "inputs": ["l0_h", "w1"]}],
        "outputs": ["l1_y"],
        "pipeline": {"axis": "pp", "micro_batches": 2, "schedule": "gpipe", "batch_inputs": ["x"]},
    }
    graph = load_spec(spec)
    with pytest.raises(LayoutPropError) as err:
        export_text(graph, "torch", data_inputs=["x", "shift"], source="mlp.yaml")
    assert err.value.code == "not-expressible" and "the model input 'shift' is no batch input" in \
        err.value.message, err.value.message
