"""A review of the morning's work (bd55af7..77df03b), tried as a user and as an attacker: gen's whole
configuration, the pipelined torch export, the commands made thin. Each test is one defect found; the
ones whose fix lies in a file another helper is editing are marked ``xfail(strict=True)`` with the
defect in their reason, so that they document it honestly and turn red once it is fixed."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import yaml

from layout_prop.cli import main

ERROR = "layout-prop: error: "


def _gen(tmp_path, name: str, args: list[str]) -> str:
    path = tmp_path / name
    assert main(["gen", "llama", "--full", *args, "-o", str(path)]) == 0
    return str(path)


def _one_error_line(capsys, argv: list[str]) -> str:
    """Run ``argv``; it must exit 2 with exactly one stderr line, ``layout-prop: error: <code>...(hint: ...)``."""
    capsys.readouterr()
    assert main(argv) == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(ERROR) and "(hint: " in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv", [["pipeline"], ["estimate", "--cluster", "a100-80g"], ["export", "--to", "torch"],
                                  ["check", "--reshard", "--backward"]])
def test_more_pipeline_stages_than_layers_is_a_bad_pipeline_error(capsys, tmp_path, argv):
    """``gen llama --full --layers 2 --mesh pp=4,...`` writes 4 stages for 2 layers; the commands reading it
    said ``internal-error: NameError: name '_bad' is not defined`` (passes/pipeline.py lost its ``_bad``
    when the blocks moved to io/spec_blocks.py) instead of the bad-pipeline error naming the counts. gen now
    refuses such a mesh itself, so the spec is gen's pp=2 one with its pp axis made 4 by hand."""
    spec = yaml.safe_load(open(_gen(tmp_path, "pp2.yaml", ["--layers", "2", "--mesh", "pp=2,dp=1,tp=2"])))
    assert spec["mesh"]["names"][0] == "pp" and spec["mesh"]["shape"][0] == 2
    spec["mesh"]["shape"][0] = 4
    (tmp_path / "pp4.yaml").write_text(yaml.safe_dump(spec))
    spec = str(tmp_path / "pp4.yaml")
    line = _one_error_line(capsys, [argv[0], spec, *argv[1:]])
    assert "internal-error" not in line and "NameError" not in line, line
    assert line.startswith(ERROR + "bad-pipeline"), line
    assert "4 pipeline chunks" in line and "2 layers" in line, line


def test_gen_refuses_more_pipeline_stages_than_layers(capsys):
    line = _one_error_line(capsys, ["gen", "llama", "--full", "--layers", "2", "--mesh", "pp=4,dp=1,tp=2"])
    assert "pp" in line and "layers" in line, line


@pytest.mark.parametrize("training", [{"global_batch": math.nan, "micro_batch": 1},
                                      {"global_batch": "4", "micro_batch": 1},
                                      {"global_batch": -4, "micro_batch": 1},
                                      {"global_batch": 4, "micro_batch": 0}],
                         ids=["nan", "string", "negative", "zero-micro-batch"])
def test_torch_export_refuses_a_bad_training_block(capsys, tmp_path, training):
    spec = yaml.safe_load(open(_gen(tmp_path, "pp.yaml", ["--layers", "2", "--batch", "4", "--mesh", "pp=2,dp=1,tp=2",
                                                          "--micro-batches", "4"])))
    spec["training"] = training
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    capsys.readouterr()
    assert main(["estimate", str(bad), "--cluster", "a100-80g"]) == 2  # the same block estimate refuses
    line = _one_error_line(capsys, ["export", str(bad), "--to", "torch"])
    assert "training." in line, line


_HF_LOAD = r"""
import importlib.util, sys
import torch, torch.distributed as dist
import transformers as T
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
spec = importlib.util.spec_from_file_location("plan", sys.argv[1])
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)
model = T.LlamaForCausalLM(T.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=8, tie_word_embeddings=False))
mesh = plan.make_mesh()
model = plan.parallelize(model, mesh)
ids = torch.randint(0, 64, (2, 8))
inputs = plan.shard_inputs(mesh, tokens=ids, labels=ids)
loss = model(input_ids=inputs["tokens"], labels=inputs["labels"]).loss
print("loss", float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
"""


@pytest.mark.xfail(strict=True, reason="export --to torch of gen llama (dp=2 x sp=1 x tp=2) places cos and sin, "
                   "which LlamaForCausalLM has not: parallelize(model, mesh) raises AttributeError 'cos'; with "
                   "them skipped the forward raises 'aten.mul.Tensor got mixed torch.Tensor and DTensor' "
                   "(TP_AXIS = None: every parameter a DTensor, the model's own rotary tables plain tensors)")
def test_gen_llamas_torch_export_runs_in_a_transformers_llama(capsys, tmp_path):
    """README: gen's names are transformers' 'so an exported plan pastes into a LlamaForCausalLM'. The names
    match (test_gen_models checks them); here the written code is run on the model, in one process over
    torch's fake process group of 4 ranks (no numbers compared: only that it runs)."""
    pytest.importorskip("torch", reason="torch is optional: pip install -e '.[torch]'")
    pytest.importorskip("transformers", reason="transformers is optional: pip install transformers")
    spec = _gen(tmp_path, "llama.yaml", ["--layers", "2", "--kv-heads", "2", "--mesh", "dp=2,sp=1,tp=2"])
    assert main(["export", spec, "--to", "torch", "-o", str(tmp_path / "plan.py")]) == 0
    proc = subprocess.run([sys.executable, "-c", _HF_LOAD, str(tmp_path / "plan.py")], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "loss" in proc.stdout


def test_gen_does_not_drop_virtual_stages_without_the_interleaved_schedule(capsys, tmp_path):
    """Virtual stages are the interleaved schedule's; given with another schedule gen must refuse them (one
    line naming both flags) or write them, never write a spec without them."""
    path = tmp_path / "vs.yaml"
    capsys.readouterr()
    code = main(["gen", "llama", "--full", "--layers", "4", "--mesh", "pp=2,tp=2", "--virtual-stages", "2",
                 "--schedule", "1f1b", "-o", str(path)])
    if code == 0:
        assert yaml.safe_load(path.read_text())["pipeline"]["virtual_stages"] == 2
    else:
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR), lines
        assert "--virtual-stages" in lines[0] and "(hint: " in lines[0], lines[0]


@pytest.mark.xfail(strict=True, reason="planner/ or perf/ (other helpers'): estimate of the spec plan --search -o "
                   "writes is not the search's figure: 125.6 against 128.4 us, 281,540 against 314,820 bytes "
                   "(gen llama --full --layers 4, a100-80g, 8 devices, global batch 16; issue 39 item 6)")
def test_estimate_of_the_searchs_spec_equals_the_search(capsys, tmp_path):
    pytest.importorskip("scipy", reason="plan needs scipy: pip install -e '.[plan]'")
    import json

    spec = _gen(tmp_path, "s.yaml", ["--layers", "4", "--mesh", "dp=1,sp=1,tp=1"])
    best = tmp_path / "best.yaml"
    capsys.readouterr()
    assert main(["plan", spec, "--search", "--cluster", "a100-80g", "--devices", "8", "--global-batch", "16",
                 "--json", "-o", str(best)]) == 0
    top = json.loads(capsys.readouterr().out)["top"][0]
    assert main(["estimate", str(best), "--cluster", "a100-80g", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["step_time_s"] == pytest.approx(top["step_time_s"], rel=1e-6)
    assert estimate["memory_per_rank_bytes"] == top["memory_per_rank_bytes"]


def test_dash_output_is_standard_output(capsys, tmp_path, monkeypatch):
    """``-o -`` wrote a file named ``-`` (gen, export), where ``-`` as an input is standard input: it is standard
    output, the same text as no ``-o`` at all, no file made and no ``wrote -`` line from gen."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["gen", "llama", "--layers", "2"]) == 0
    plain = capsys.readouterr().out
    assert main(["gen", "llama", "--layers", "2", "-o", "-"]) == 0
    dashed = capsys.readouterr()
    assert plain.startswith("mesh:") and dashed.out == plain
    assert "wrote" not in dashed.err, dashed.err
    (tmp_path / "s.yaml").write_text(plain)
    assert main(["export", "s.yaml", "--to", "torch"]) == 0
    code = capsys.readouterr().out
    assert main(["export", "s.yaml", "--to", "torch", "-o", "-"]) == 0
    dashed = capsys.readouterr()
    assert "def parallelize" in code and dashed.out == code
    assert "wrote" not in dashed.err, dashed.err
    assert not (tmp_path / "-").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


@pytest.mark.parametrize("argv, flag", [
    (["plan", "s.yaml", "-o", "-"], "-o"),
    (["plan", "s.yaml", "--search", "--cluster", "a100-80g", "--devices", "8", "--global-batch", "8",
      "--plan-out", "-"], "--plan-out"),
    (["export", "s.yaml", "--to", "torch", "--data", "-"], "--data"),
    (["export", "s.yaml", "--to", "torch", "-o", "-", "--data", "-"], "--data"),
])
def test_dash_output_beside_printed_output_is_refused(argv, flag, capsys, tmp_path, monkeypatch):
    """Where a command prints its report (plan, plan --search) or its code (export without -o FILE) on standard
    output, ``-`` for a file it writes would mix the two on one stream: one bad-usage line naming the flag,
    exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    assert main(["gen", "llama", "--layers", "1", "-o", "s.yaml"]) == 0
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith(f"layout-prop: error: bad-usage at {flag}:"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]
