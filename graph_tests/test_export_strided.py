"""Strided shards exported and executed: ``gen gpt`` cuts GPT-2's fused q,k,v weight ``c_attn.weight`` (H, 3H)
on tp as ``_S(1,3)`` (each tp rank holds its chunk of each of q, k and v). ``export --to torch`` writes it as
torch's ``_StridedShard(1, split_factor=3)``; the plan run on 4 gloo processes (dp=2 x tp=2) gives the loss and
every parameter's gradient of one process. MindSpore and hyper-parallel: see the refusal and tensor_map tests.

torch is optional: the execution test is skipped without it (``pip install -e '.[torch]'``).
"""

from __future__ import annotations

import math

import pytest

from layout_prop.commands.export import export_text
from layout_prop.frontends.generate import gpt_spec
from layout_prop.io.loader import load_spec

WORLD = 4


def _spec() -> dict:
    return gpt_spec(layers=1, mesh=(("dp", 2), ("sp", 1), ("tp", 2)), batch=4, seq=8, hidden=32, heads=4,
                    vocab=64, dropout=0.0)


def _export(spec: dict, target: str) -> str:
    _, code = export_text(load_spec(spec), target, source="gpt.yaml")
    return code


# ----------------------------------------------------------------------------- a GPT by gen gpt's names
def _gpt_module(spec: dict, plan: dict | None):
    """``gen gpt``'s training graph as a torch module: its parameters under the spec's names (nested modules),
    ``forward(tokens, labels)`` the mean next-token cross entropy with the tied output head."""
    import torch
    import torch.nn.functional as F

    from graph_tests.torch_gen_llama import _holder, like

    nodes = {n["name"]: n for n in spec["nodes"]}
    heads = nodes["l0_q_heads"]["attrs"]["shape"][2]
    layers = sorted({int(n.split("_")[0][1:]) for n in nodes if n.startswith("l") and n.split("_")[0][1:].isdigit()})

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            for name, entry in spec["inputs"].items():
                if entry.get("dtype", "float32").startswith("int"):
                    continue
                shape = entry["shape"]
                value = (1.0 + 0.1 * torch.randn(shape, generator=gen) if name.endswith("ln_1.weight")
                         or name.endswith("ln_2.weight") or name.endswith("ln_f.weight")
                         else torch.randn(shape, generator=gen) / math.sqrt(shape[-1]))
                module, leaf = _holder(self, name)
                module.register_parameter(leaf, torch.nn.Parameter(value))

        def p(self, name):
            module, leaf = _holder(self, name)
            return getattr(module, leaf)

        def ln(self, x, prefix):
            return F.layer_norm(x, x.shape[-1:], self.p(prefix + ".weight"), self.p(prefix + ".bias"), 1e-5)

        def layer(self, i, x):
            pre = f"transformer.h.{i}."
            b, s, hidden = x.shape
            hd = hidden // heads
            qkv = self.ln(x, pre + "ln_1") @ self.p(pre + "attn.c_attn.weight") + self.p(pre + "attn.c_attn.bias")
            q, k, v = (t.reshape(b, s, heads, hd).transpose(1, 2) for t in qkv.split(hidden, dim=-1))
            mask = torch.full((s, s), float("-inf")).triu(1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
            attn = torch.softmax(scores + like(mask, scores), dim=-1) @ v  # CPU sdpa has no DTensor rule
            attn = attn.transpose(1, 2).reshape(b, s, hidden)
            x = x + attn @ self.p(pre + "attn.c_proj.weight") + self.p(pre + "attn.c_proj.bias")
            h = F.gelu(self.ln(x, pre + "ln_2") @ self.p(pre + "mlp.c_fc.weight") + self.p(pre + "mlp.c_fc.bias"))
            return x + h @ self.p(pre + "mlp.c_proj.weight") + self.p(pre + "mlp.c_proj.bias")

        def forward(self, tokens, labels):
            wte = self.p("transformer.wte.weight")
            x = F.embedding(tokens, wte)
            if plan:
                x = plan["settle"]("embedded", x)
            x = x + self.p("transformer.wpe.weight")
            for i in layers:
                x = self.layer(i, x)
            logits = F.linear(self.ln(x, "transformer.ln_f"), wte)
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return GPT()


def _batch(spec: dict):
    import torch

    gen = torch.Generator().manual_seed(1)
    b, s = spec["inputs"]["tokens"]["shape"]
    vocab = spec["inputs"]["transformer.wte.weight"]["shape"][0]
    return torch.randint(0, vocab, (b, s), generator=gen), torch.randint(0, vocab, (b, s), generator=gen)


def _reference(spec: dict):
    model = _gpt_module(spec, None)
    loss = model(*_batch(spec))
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, store: str, spec: dict, code: str, out: str):
    """One rank: the exported plan applied to the GPT, forward and backward; rank 0 saves the loss and every
    parameter's gradient (full tensors) and each parameter's placements."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        plan: dict = {}
        exec(compile(code, "exported_plan.py", "exec"), plan)
        mesh = plan["make_mesh"]("cpu")
        model = plan["parallelize"](_gpt_module(spec, plan), mesh)
        tokens, labels = _batch(spec)
        loss = model(**plan["shard_inputs"](mesh, tokens=tokens, labels=labels))
        loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        loss = loss.detach()
        full = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for n, p in model.named_parameters()}
        placements = {n: repr(tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
        local = model.get_parameter("transformer.h.0.attn.c_attn.weight")
        if rank == 0:
            torch.save({"loss": float(loss), "grads": full, "placements": placements,
                        "local_shape": tuple(local.to_local().shape)}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _start(fn, args) -> None:
    import multiprocessing

    import torch.multiprocessing as mp

    try:
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
    except (ValueError, RuntimeError):
        pass
    mp.start_processes(fn, args=args, nprocs=WORLD, start_method="forkserver")


def test_torch_export_writes_the_fused_qkv_weight_as_torchs_strided_shard():
    code = _export(_spec(), "torch")
    assert "'transformer.h.0.attn.c_attn.weight': (Replicate(), _StridedShard(1, split_factor=3))" in code
    assert "'transformer.h.0.attn.c_attn.bias': (Replicate(), _StridedShard(0, split_factor=3))" in code
    assert "from torch.distributed.tensor.placement_types import _StridedShard" in code


def test_gpt_tp_dp_with_strided_qkv_forward_backward_equal_one_process(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is optional: pip install -e '.[torch]'")
    spec = _spec()
    code = _export(spec, "torch")
    out = tmp_path / "rank0.pt"
    _start(_worker, (WORLD, str(tmp_path / "store"), spec, code, str(out)))
    result = torch.load(out)
    # the parameter really is held strided: (H, 3H / tp) locally, torch's _StridedShard on tp
    assert result["local_shape"] == (32, 48)
    assert "_StridedShard(dim=1, sf=3)" in result["placements"]["transformer.h.0.attn.c_attn.weight"]
    loss, grads = _reference(spec)
    assert abs(result["loss"] - loss) < 1e-5, (result["loss"], loss)
    assert sorted(result["grads"]) == sorted(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_strided_shard_matches_layout_props_meaning():
    """torch's _StridedShard(1, split_factor=3) on 2 ranks holds the columns layout-prop's _S(1,3) gives each
    rank: its half of each of q, k and v (checked on the split torch itself makes, one process)."""
    torch = pytest.importorskip("torch", reason="torch is optional: pip install -e '.[torch]'")
    from torch.distributed.tensor.placement_types import _StridedShard

    full = torch.arange(12.0).reshape(1, 12)  # q = 0..3, k = 4..7, v = 8..11
    shards, _ = _StridedShard(1, split_factor=3)._split_tensor(full, 2, with_padding=False, contiguous=True)
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]


def test_torch_export_writes_moes_fused_gate_up_as_torchs_strided_shard():
    from layout_prop.frontends.generate import moe_spec

    code = _export(moe_spec(), "torch")
    line = next(x for x in code.splitlines() if "'model.layers.0.mlp.experts.gate_up_proj':" in x)
    assert "_StridedShard(1, split_factor=2)" in line, line


# ----------------------------------------------------------------------------- MindSpore and hyper-parallel
INNER_FIRST = """mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [8, 16], placements: [R, R]}
  w: {shape: [16, 8], placements: ['_S(0,2)', S(0)]}
nodes:
  - {name: y, op: matmul, inputs: [x, w]}
outputs: [y]
"""


def _cli(capsys, argv) -> tuple[int, str, str]:
    from layout_prop.cli import main

    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err.strip()


def test_mindspore_writes_an_inner_first_strided_layout_as_its_tensor_map(capsys, tmp_path):
    """``(_S(0,2), S(0))`` on dp x tp: tp cuts w's rows into 2 major blocks, dp each block in 2: the tensor_map
    entry ``(tp, dp)`` (inner axis first), 4 pieces of dim 0."""
    spec = tmp_path / "inner.yaml"
    spec.write_text(INNER_FIRST)
    code, out, err = _cli(capsys, ["export", str(spec), "--to", "mindspore", "--input", "x", "-o", str(tmp_path / "m.py")])
    assert code == 0, err
    scope: dict = {}
    exec((tmp_path / "m.py").read_text(), scope)
    assert scope["PARAMETER_LAYOUTS"]["w"] == (("tp", "dp"), "None")
    assert scope["STRATEGIES"]["y"]["in_strategy"] == ((1, 1), (4, 1))


@pytest.mark.parametrize("target", ["mindspore", "hyper-parallel"])
def test_gpts_fused_qkv_strided_shard_is_refused_in_one_line_with_the_workaround(capsys, tmp_path, target):
    spec = tmp_path / "gpt.yaml"
    import yaml

    gpt = _spec()
    if target == "hyper-parallel":  # its refusal of a row-cut (vocabulary-parallel) embedding would come first
        gpt["inputs"]["transformer.wte.weight"]["placements"] = ["R", "R", "R"]
    spec.write_text(yaml.safe_dump(gpt))
    code, _, err = _cli(capsys, ["export", str(spec), "--to", target, "-o", str(tmp_path / "m.py")])
    assert code == 2
    assert err.count("\n") == 0 and "not-expressible" in err, err
    # the fused weight (_S(1,3)) or its bias (_S(0,3)), whichever the export meets first
    assert ("'transformer.h.0.attn.c_attn.weight'" in err and "_S(1,3)" in err
            or "'transformer.h.0.attn.c_attn.bias'" in err and "_S(0,3)" in err), err
    assert "colwise" in err, err
