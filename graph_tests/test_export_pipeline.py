"""Pipelined plans exported to MindSpore and hyper-parallel, and MindSpore's selective recomputation.

- MindSpore: the exported module, executed with MindSpore on CPU, builds every strategy and Layout on the
  stage mesh, gives each Cell its pipeline_stage, wraps the network in MindSpore's ``Pipeline`` (micro-batches)
  and sets ``AutoParallel.pipeline``; selective recomputation sets ``Primitive.recompute()`` on the attention
  core's primitives. Its semi-auto parallel compile and execution need Ascend or GPU: not run here.
- hyper-parallel: the exported module runs a training step through the snapshot's own ``shard_module`` and
  ``PipelineStage`` with ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` on its torch platform (4 gloo
  processes on CPU: 2 stages x tp=2), and every gradient and the loss equal one process's (skipped without
  torch or the snapshot).
- What neither target runs is one line naming it (interleaved for MindSpore; GPipe, a pipeline axis not first,
  for hyper-parallel).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from layout_prop.cli import main

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT.parent / "shared" / "upstream" / "hyper-parallel"

MLP_PP = """
mesh: {shape: [2, 2], names: [pp, tp]}
inputs:
  x: {shape: [8, 16], placements: [R, R]}
  target: {shape: [8, 16], placements: [R, "S(0)"], requires_grad: false}
  l0.fc1.weight: {shape: [32, 16], placements: [R, "S(0)"]}
  l0.fc2.weight: {shape: [16, 32], placements: [R, "S(1)"]}
  l1.fc1.weight: {shape: [32, 16], placements: [R, "S(0)"]}
  l1.fc2.weight: {shape: [16, 32], placements: [R, "S(1)"]}
nodes:
  - {name: l0_fc1, op: linear, inputs: [x, l0.fc1.weight]}
  - {name: l0_act, op: gelu, inputs: [l0_fc1]}
  - {name: l0_fc2, op: linear, inputs: [l0_act, l0.fc2.weight]}
  - {name: l1_fc1, op: linear, inputs: [l0_fc2, l1.fc1.weight]}
  - {name: l1_act, op: gelu, inputs: [l1_fc1]}
  - {name: l1_fc2, op: linear, inputs: [l1_act, l1.fc2.weight]}
  - {name: diff, op: sub, inputs: [l1_fc2, target]}
  - {name: sq, op: mul, inputs: [diff, diff]}
  - {name: loss, op: mean, inputs: [sq]}
outputs: [loss]
"""


def _llama_pp(tmp_path, block: str, layers: int = 2, batch: int = 4) -> Path:
    """gen llama (--full) on pp=2 x dp=2 x tp=2 (every input R on pp) with ``block`` appended."""
    from layout_prop.frontends.generate import llama_spec
    from layout_prop.io.loader import format_spec

    spec = yaml.safe_load(format_spec(llama_spec(layers=layers, full=True, batch=batch,
                                                 mesh=(("dp", 2), ("sp", 1), ("tp", 2))), None))
    spec["mesh"] = {"shape": [2, 2, 2], "names": ["pp", "dp", "tp"]}
    for entry in spec["inputs"].values():
        if "placements" in entry:  # [dp, sp, tp] -> [pp, dp, tp]: sp (size 1) becomes pp, R
            dp, _, tp = entry["placements"]
            entry["placements"] = ["R", dp, tp]
    path = tmp_path / "llama_pp.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False) + block)
    return path


def _export(capsys, spec: Path, target: str, *extra) -> str:
    capsys.readouterr()
    code = main(["export", str(spec), "--to", target, *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


# --------------------------------------------------------------------------- MindSpore
def test_mindspore_builds_a_pipelined_plan_with_selective_recompute_on_cpu(capsys, tmp_path):
    """gen llama on pp=2 x dp=2 x tp=2, 1f1b over 2 micro-batches, selective recomputation: the strategies are the
    stage mesh's (dp x tp, as check SPEC reports them), each Cell gets the stage layout-prop pipeline SPEC gives
    its layer, MindSpore's Pipeline wrapper and AutoParallel.pipeline are built, and the attention core's
    primitives are recomputed. Compile and execution need Ascend or GPU: not run."""
    pytest.importorskip("mindspore", reason="MindSpore is optional: pip install -e '.[mindspore]'")
    from mindspore import nn

    spec = _llama_pp(tmp_path, "pipeline: {axis: pp, micro_batches: 2, schedule: 1f1b}\nrecompute: selective\n")
    out = _export(capsys, spec, "mindspore")
    ns: dict = {}
    exec(compile(out, "plan.py", "exec"), ns)
    assert ns["DEVICE_MATRIX"] == (2, 2) and ns["ALIAS_NAME"] == ("dp", "tp")
    assert ns["PIPELINE_STAGES"] == 2 and ns["MICRO_BATCHES"] == 2 and ns["PIPELINE_SCHEDULER"] == "1f1b"
    # the stages layout-prop pipeline SPEC prints for this spec: chunk 0 = embedded .. l0_out, chunk 1 = l1_h .. loss
    capsys.readouterr()
    assert main(["pipeline", str(spec)]) == 0
    printed = capsys.readouterr().out
    assert "chunk 0 on stage 0: 24 nodes, embedded .. l0_out" in printed, printed
    assert "chunk 1 on stage 1: 28 nodes, l1_h .. loss" in printed, printed
    assert ns["LAYER_STAGES"] == {"l0": 0, "l1": 1}
    assert ns["NODE_STAGES"]["embedded"] == 0 and ns["NODE_STAGES"]["loss"] == 1
    assert len(ns["NODE_STAGES"]) == 24 + 28
    # every strategy on the stage mesh: at most dp x tp = 4 pieces a tensor
    built = {node: ns["shard_primitive"](node) for node in ns["STRATEGIES"]}
    assert sum(p is not None for p in built.values()) >= 15
    for node, entry in ns["STRATEGIES"].items():
        for pieces in entry["in_strategy"]:
            count = 1
            for p in pieces:
                count *= p
            assert count <= 4, (node, entry)
        assert len(ns["in_layouts"](node)) == len(entry["in_strategy"])
    assert len(ns["parameter_layouts"]()) == len(ns["PARAMETER_LAYOUTS"]) > 5
    # selective: the attention core (4-D values whose last two dims are equal), recomputed primitive by primitive
    assert set(ns["RECOMPUTE_NODES"]) == {"l0", "l1"} and "l0_attn" in ns["RECOMPUTE_NODES"]["l0"]
    chosen = {n for nodes in ns["RECOMPUTE_NODES"].values() for n in nodes}
    for node, prim in built.items():
        if prim is not None:
            assert bool(prim.attrs.get("recompute")) == (node in chosen), node
    assert any(built[n] is not None for n in chosen)  # some of them are MindSpore primitives
    # Cells get their stages and the Pipeline wrapper; AutoParallel takes the stages and the scheduler
    layers = nn.SequentialCell([nn.Dense(4, 4), nn.Dense(4, 4)])
    wrapped = ns["pipeline"](layers, {"l0": layers[0], "l1": layers[1]})
    assert type(wrapped).__name__ == "Pipeline" and wrapped.micro_size == 2
    assert (layers[0].pipeline_stage, layers[1].pipeline_stage) == (0, 1)
    parallel = ns["auto_parallel"](wrapped)
    assert (parallel._pipeline_stages, parallel._pipeline_scheduler) == (2, "1f1b")
    with pytest.raises(KeyError, match="no layer or op node"):
        ns["pipeline"](layers, {"l7": layers[0]})


def test_mindspore_full_recompute_passes_the_communication_options(capsys, tmp_path):
    """recompute: full with ZeRO-3: Cell.recompute with mp_comm_recompute and parallel_optimizer_comm_recompute
    (ZeRO-3 gathers the weights again for the recomputation); a Cell so marked takes them."""
    pytest.importorskip("mindspore", reason="MindSpore is optional: pip install -e '.[mindspore]'")
    from mindspore import nn

    from layout_prop.frontends.generate import llama_spec
    from layout_prop.io.loader import format_spec

    spec = tmp_path / "full.yaml"
    spec.write_text(format_spec(llama_spec(full=True), None) + "zero: {stage: 3}\nrecompute: {mode: full, layers: [l0]}\n")
    ns: dict = {}
    exec(compile(_export(capsys, spec, "mindspore"), "plan.py", "exec"), ns)
    assert ns["RECOMPUTE"] == "full" and ns["RECOMPUTE_LAYERS"] == ("l0",) and ns["RECOMPUTE_NODES"] == {}
    assert ns["MP_COMM_RECOMPUTE"] is True and ns["PARALLEL_OPTIMIZER_COMM_RECOMPUTE"] is True
    assert ns["PIPELINE_STAGES"] == 1
    cells = {"l0": nn.Dense(4, 4), "l1": nn.Dense(4, 4)}
    ns["recompute_cells"](cells)
    assert cells["l0"]._has_config_recompute and not cells["l1"]._has_config_recompute
    plain = nn.Dense(4, 4)
    assert ns["pipeline"](plain, {}) is plain  # no pipeline: the network as it is


def test_mindspore_refuses_an_interleaved_pipeline_in_one_line(capsys, tmp_path):
    spec = _llama_pp(tmp_path, "pipeline: {axis: pp, micro_batches: 4, schedule: interleaved, virtual_stages: 2}\n",
                     layers=4, batch=8)
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "mindspore"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not-expressible" in err[0] and "interleaved schedule (2 stages x 2 virtual on pp)" \
        in err[0] and "write schedule: 1f1b" in err[0], err


# --------------------------------------------------------------------------- hyper-parallel
def test_hyper_parallel_refuses_gpipe_and_a_pipeline_axis_not_first(capsys, tmp_path):
    """The snapshot's ScheduleGPipe fails when built, and its PipelineStage runs stage s on ranks s*n..s*n+n-1:
    each is one line naming it."""
    spec = tmp_path / "gpipe.yaml"
    spec.write_text(MLP_PP + "pipeline: {axis: pp, micro_batches: 2, schedule: gpipe, batch_inputs: [x, target]}\n")
    capsys.readouterr()
    assert main(["export", str(spec), "--to", "hyper-parallel", "--input", "x", "--input", "target"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ScheduleGPipe fails when it is built" in err[0], err
    spec = tmp_path / "last.yaml"
    last = yaml.safe_load(MLP_PP)
    last["mesh"]["names"] = ["tp", "pp"]
    for entry in last["inputs"].values():
        entry["placements"] = entry["placements"][::-1]
    spec.write_text(yaml.safe_dump(last) + "pipeline: {axis: pp, micro_batches: 2, batch_inputs: [x, target]}\n")
    assert main(["export", str(spec), "--to", "hyper-parallel", "--input", "x", "--input", "target"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "put pp first in the mesh" in err[0], err


PIPE_WORKER = '''
import copy, faulthandler, json, os, sys
import torch, torch.distributed as dist

os.environ["HYPER_PARALLEL_PLATFORM"] = "torch"
SNAPSHOT, PLAN, OUT, PORT, BLOCKS = sys.argv[1:6]
sys.path.insert(0, SNAPSHOT)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        for i in range(blocks):
            setattr(self, f"l{i}", Block())
        self.blocks = blocks

    def forward(self, x, target):
        for i in range(self.blocks):
            x = getattr(self, f"l{i}")(x)
        return ((x - target) ** 2).mean()


class Chunk(torch.nn.Module):  # the model without the other chunks' modules: its names kept
    def __init__(self, model, c):
        super().__init__()
        self.c, self.last = c, c == model.blocks - 1
        setattr(self, f"l{c}", getattr(model, f"l{c}"))

    def forward(self, h=None, x=None, target=None):  # what it receives; the model's inputs by name
        h = getattr(self, f"l{self.c}")(x if self.c == 0 else h)
        return ((h - target) ** 2).mean() if self.last else h


def work(rank, world):
    faulthandler.dump_traceback_later(400, exit=False, file=open(f"{OUT}.rank{rank}.txt", "w"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from hyper_parallel import shard_module

    ns = {}
    exec(compile(open(PLAN).read(), PLAN, "exec"), ns)
    torch.manual_seed(0)
    model, x, target = Model(int(BLOCKS)), torch.randn(8, 16), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    ref_loss = reference(x, target)
    ref_loss.backward()
    mesh = ns["make_mesh"]("cpu")
    chunks = ns["local_chunks"](rank, world)
    modules = {c: shard_module(Chunk(model, c), mesh, ns["chunk_plan"](mesh, c)) for c in chunks}
    schedule = ns["pipeline_schedule"](modules, mesh)
    # each stage is given the model inputs its chunks read (every local chunk sees them, by name)
    losses = schedule.run(x=x) if 0 in chunks else schedule.run(target=target)
    report = {"chunks": chunks, "grads": {}}
    if losses:
        total = sum(float(l.full_tensor() if hasattr(l, "full_tensor") else l) for l in losses)
        report["loss"] = total  # each micro-batch's loss is divided by the micro-batches already (a mean)
        report["ref_loss"] = float(ref_loss)
    for name, p in [(n, p) for m in modules.values() for n, p in m.named_parameters()]:
        grad = p.grad
        if not hasattr(grad, "full_tensor") and hasattr(p, "placements"):  # a DTensor parameter's local gradient
            from hyper_parallel.core.dtensor import DTensor

            grad = DTensor.from_local(grad, p.device_mesh, p.placements)
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        ref = dict(reference.named_parameters())[name.replace("module.", "", 1)].grad
        report["grads"][name] = float((grad - ref).abs().max())
    with open(f"{OUT}.{rank}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(work, args=(4,), nprocs=4)
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blocks_spec(blocks: int, block: str) -> str:
    """``blocks`` MLP blocks (fc1 cut on its rows, fc2 on its columns) on pp=2 x tp=2 and a mean-squared loss."""
    spec = yaml.safe_load(MLP_PP)
    spec["inputs"] = {k: v for k, v in spec["inputs"].items() if not k.startswith("l")}
    spec["nodes"] = []
    value = "x"
    for i in range(blocks):
        spec["inputs"][f"l{i}.fc1.weight"] = {"shape": [32, 16], "placements": ["R", "S(0)"]}
        spec["inputs"][f"l{i}.fc2.weight"] = {"shape": [16, 32], "placements": ["R", "S(1)"]}
        spec["nodes"] += [{"name": f"l{i}_fc1", "op": "linear", "inputs": [value, f"l{i}.fc1.weight"]},
                          {"name": f"l{i}_act", "op": "gelu", "inputs": [f"l{i}_fc1"]},
                          {"name": f"l{i}_fc2", "op": "linear", "inputs": [f"l{i}_act", f"l{i}.fc2.weight"]}]
        value = f"l{i}_fc2"
    spec["nodes"] += [{"name": "diff", "op": "sub", "inputs": [value, "target"]},
                      {"name": "sq", "op": "mul", "inputs": ["diff", "diff"]},
                      {"name": "loss", "op": "mean", "inputs": ["sq"]}]
    return yaml.safe_dump(spec, sort_keys=False) + block


@pytest.mark.parametrize("schedule, blocks", [("1f1b", 2), ("interleaved", 4)])
def test_hyper_parallel_runs_a_pipelined_training_step_equal_to_one_process(capsys, tmp_path, schedule, blocks):
    """MLP blocks on pp=2 x tp=2 over 2 micro-batches, 1f1b (2 chunks) and interleaved (4 chunks, 2 a stage): the
    exported module's chunk_plan, stage_module and pipeline_schedule, run by the snapshot's shard_module,
    PipelineStage and Schedule1F1B / ScheduleInterleaved1F1B on 4 gloo processes: the loss (the micro-batches'
    mean) and every weight's gradient equal one process's."""
    pytest.importorskip("torch", reason="torch is optional: pip install -e '.[torch]'")
    if not (SNAPSHOT / "hyper_parallel").is_dir():
        pytest.skip(f"the shared hyper-parallel snapshot is not at {SNAPSHOT}")
    virtual = ", virtual_stages: 2" if schedule == "interleaved" else ""
    spec = tmp_path / "mlp_pp.yaml"
    spec.write_text(_blocks_spec(blocks, f"pipeline: {{axis: pp, micro_batches: 2, schedule: {schedule}{virtual}, "
                                         "batch_inputs: [x, target]}\n"))
    code = _export(capsys, spec, "hyper-parallel", "--input", "x", "--input", "target")
    assert f"CHUNKS = {blocks}" in code and f"SCHEDULE = {schedule!r}" in code
    assert "    0: ('l0.fc1.weight', 'l0.fc2.weight'),\n    1: ('l1.fc1.weight', 'l1.fc2.weight')," in code
    assert "            ('l0_fc2', (Replicate(),))," in code  # what chunk 1 receives: fc2's sum, reduced
    (tmp_path / "plan.py").write_text(code)
    (tmp_path / "worker.py").write_text(PIPE_WORKER)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(SNAPSHOT), str(tmp_path / "plan.py"),
                          str(out), str(_free_port()), str(blocks)], capture_output=True, text=True, timeout=590)
    dumps = "".join(p.read_text() for p in sorted(tmp_path.glob("out.rank*.txt")))
    assert run.returncode == 0, (run.stderr[-3000:], dumps[-3000:])
    reports = [json.loads((tmp_path / f"out.{rank}.json").read_text()) for rank in range(4)]
    local = [[0, 2], [0, 2], [1, 3], [1, 3]] if blocks == 4 else [[0], [0], [1], [1]]
    assert [r["chunks"] for r in reports] == local
    for report in reports:
        assert len(report["grads"]) == 2 * len(report["chunks"]), report
        assert max(report["grads"].values()) < 1e-5, report
        if blocks - 1 in report["chunks"]:
            assert abs(report["loss"] - report["ref_loss"]) < 1e-5, report
