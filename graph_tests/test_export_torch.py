"""The torch export, executed: layout-prop's plan for the tiny Hugging Face Llama of the fixtures
(examples/models/llama.onnx) applied with ``parallelize_module`` on 4 simulated ranks (torch's
``LocalTensorMode`` over a fake process group) gives one device's logits and the placements layout-prop
checked.

torch is optional (never a dependency of CI); the module is skipped where it does not import. The model
is a small torch module written here after Hugging Face's ``LlamaForCausalLM`` (the fixture's config:
hidden 64, 4 heads, 2 key/value heads, 2 layers, vocab 128), loaded with the fixture's own weights; that
it is the same model is checked first: its logits equal the ones torch computed when the fixture was made
(examples/models/llama.npz).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is optional: pip install torch --index-url "
                                            "https://download.pytorch.org/whl/cpu to run the torch export test")
pytest.importorskip("torch.distributed._local_tensor", reason="this torch has no LocalTensorMode")

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "models" / "llama.onnx"
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS, EPS, THETA = 64, 4, 2, 128, 128, 2, 1e-6, 10000.0

PLAN = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  input_ids: [R, R]                 # the fixture's batch is 1: nothing to cut on dp
parameters:
  "*.self_attn.[qkv]_proj.weight": colwise
  "*.self_attn.o_proj.weight": rowwise
  "*.mlp.gate_proj.weight": colwise
  "*.mlp.up_proj.weight": colwise
  "*.mlp.down_proj.weight": rowwise
  "model.embed_tokens.weight": vocab
  "*": R
"""


# --------------------------------------------------------------------------- the model, after transformers
class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q_proj = torch.nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its own heads (torch's Megatron convention)
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        mask = torch.full((s, s), float("-inf")).triu(1)
        out = torch.softmax(scores + mask, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)


class Llama(torch.nn.Module):
    """LlamaForCausalLM's module names: model.embed_tokens, model.layers.N.self_attn.q_proj, lm_head..."""

    def __init__(self):
        super().__init__()
        self.model = Body()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids):
        s = input_ids.shape[1]
        dim = HIDDEN // HEADS
        inv_freq = 1.0 / THETA ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def _weights(folder: Path) -> dict:
    """The fixture's weights by torch's names, as ``run MODEL --plan`` reads them (``load_with_weights``)."""
    from layout_prop.commands.run import load_with_weights

    plan = folder / "plan.yaml"
    plan.write_text(PLAN)  # any plan: only the weights are read here
    _, weights, unread = load_with_weights(argparse.Namespace(spec=str(MODEL), plan=str(plan), opaque=False))
    assert not unread
    return weights


def _load_fixture(model: Llama, weights: dict) -> None:
    """Copy the fixture's weights into the module. The dynamo exporter folded every Linear weight as
    (in, out): those are transposed back; the RMSNorm weights were de-duplicated into one tensor (all
    ones at init) that every norm takes."""
    norm = weights["model.layers.0.input_layernorm.weight"]
    state = {}
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            value = norm
        else:
            value = weights[name]
            if name.endswith("_proj.weight") or name == "lm_head.weight":
                value = value.T
        assert tuple(value.shape) == tuple(param.shape), name
        state[name] = torch.from_numpy(np.array(value))  # a writable copy
    model.load_state_dict(state)


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory):
    torch.manual_seed(0)
    model = Llama().eval()
    _load_fixture(model, _weights(tmp_path_factory.mktemp("weights")))
    return model


def test_the_torch_mirror_is_the_fixtures_model(fixture_model):
    """Before any sharding: the module and weights compute the logits torch computed for the fixture."""
    data = np.load(ROOT / "examples" / "models" / "llama.npz")
    with torch.no_grad():
        logits = fixture_model(torch.from_numpy(data["input_ids"])).numpy()
    np.testing.assert_allclose(logits, data["logits"], rtol=1e-4, atol=1e-4)


def _export(tmp_path):
    from layout_prop.commands.export import export_text
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    plan = load_plan(PLAN)
    graph = build_graph(read_model(MODEL, plan), plan)
    export, code = export_text(graph, "torch", source=MODEL.name)
    path = tmp_path / "tp_plan.py"
    path.write_text(code)
    namespace: dict = {}
    exec(compile(code, str(path), "exec"), namespace)  # the file a user pastes, as written
    return export, namespace


def test_parallelize_module_with_the_export_gives_one_devices_logits(fixture_model, tmp_path):
    import copy

    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    export, ns = _export(tmp_path)
    assert ns["TP_AXIS"] == "tp" and len(ns["PARALLELIZE_PLAN"]) == 15  # 7 styles a layer and the embedding
    ids = torch.from_numpy(np.load(ROOT / "examples" / "models" / "llama.npz")["input_ids"])
    with torch.no_grad():
        reference = fixture_model(ids)
    world = 4
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", world_size=world, rank=0, store=FakeStore())
    try:
        with LocalTensorMode(frozenset(range(world))), torch.no_grad():
            mesh = ns["make_mesh"]("cpu")
            model = ns["parallelize"](copy.deepcopy(fixture_model), mesh)
            out = model(**ns["shard_inputs"](mesh, input_ids=ids))
            out = out.wait() if hasattr(out, "wait") else out
            per_rank = {r: t.clone() for r, t in out._local_tensors.items()}
            placed = {}
            for name, param in model.named_parameters():
                if isinstance(param, DTensor):
                    placed[name] = tuple(param.placements)
    finally:
        dist.destroy_process_group()
    # the logits: layout-prop predicts them replicated on both axes, so every rank holds all of them
    assert export.outputs and all(layout.is_replicated() for layout in export.outputs.values())
    assert sorted(per_rank) == list(range(world))
    for rank, local in per_rank.items():
        assert tuple(local.shape) == tuple(reference.shape)
        np.testing.assert_allclose(local.numpy(), reference.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"rank {rank}")
    # the placements torch gave each parameter (on the tp sub-mesh) are layout-prop's on the tp axis
    from torch.distributed.tensor import Replicate, Shard

    expected = {}
    for name, tensor in export.parameters.items():
        if tensor.kind != "parameter":
            continue
        layout = tensor.own_layout()
        assert str(layout.placements[0]) == "R", name  # nothing on dp
        p = layout.placements[1]
        expected[name] = Replicate() if str(p) == "R" else Shard(p.dim)
    sharded = {n: p for n, p in expected.items() if p != Replicate()}
    assert len(sharded) == 15
    assert placed == {n: (p,) for n, p in sharded.items()}  # replicated ones stay plain tensors


MLP_SPEC = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [8, 16], placements: ["S(0)", R]}
  fc1.weight: {shape: [16, 32], placements: [R, "S(1)"]}
  fc2.weight: {shape: [32, 16], placements: [R, "S(0)"]}
nodes:
  - {name: fc1, op: matmul, inputs: [x, fc1.weight]}
  - {name: act, op: relu, inputs: [fc1]}
  - {name: fc2, op: matmul, inputs: [act, fc2.weight]}
outputs: [fc2]
"""


class Proj(torch.nn.Module):
    """A product with its weight held (in, out), as a spec's matmul reads it (no nn.Linear: no style fits)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out))

    def forward(self, x):
        return x @ self.weight


class SpecMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = Proj(16, 32), Proj(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_explicit_placements_run_on_dtensors_and_give_the_predicted_output_layout(tmp_path):
    """No style fits a spec's (in, out) weights: every parameter and input becomes a DTensor with
    layout-prop's placements; on 4 ranks the output is one device's, and its placements are the ones
    layout-prop predicts (S(0) on dp, a partial sum on tp)."""
    import copy

    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor, Partial, Shard

    from layout_prop.commands.export import export_text
    from layout_prop.io.loader import load_spec

    export, code = export_text(load_spec(MLP_SPEC), "torch", data_inputs=["x"])
    ns: dict = {}
    exec(compile(code, str(tmp_path / "mlp_plan.py"), "exec"), ns)
    assert ns["TP_AXIS"] is None and ns["PARALLELIZE_PLAN"] == {}
    assert export.outputs["fc2"].placement_strs() == ["S(0)", "P(sum)"]
    torch.manual_seed(0)
    module, x = SpecMLP(), torch.randn(8, 16)
    with torch.no_grad():
        reference = module(x)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", world_size=4, rank=0, store=FakeStore())
    try:
        with LocalTensorMode(frozenset(range(4))), torch.no_grad():
            mesh = ns["make_mesh"]("cpu")
            model = ns["parallelize"](copy.deepcopy(module), mesh)
            out = model(**ns["shard_inputs"](mesh, x=x))
            assert isinstance(out, DTensor)
            placements = tuple(out.placements)
            weights = {n: tuple(p.placements) for n, p in model.named_parameters()}
            full = out.full_tensor()
            full = {r: t.clone() for r, t in full._local_tensors.items()} if hasattr(full, "_local_tensors") \
                else {0: full.clone()}
    finally:
        dist.destroy_process_group()
    assert placements == (Shard(0), Partial("sum"))
    assert weights == {"fc1.weight": (ns["Replicate"](), Shard(1)), "fc2.weight": (ns["Replicate"](), Shard(0))}
    for rank, value in full.items():
        np.testing.assert_allclose(value.numpy(), reference.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")


SNAPSHOT = ROOT.parent / "shared" / "upstream" / "hyper-parallel"

LINEAR_MLP_SPEC = """
mesh: {shape: [2, 2], names: [dp, tp]}
inputs:
  x: {shape: [8, 16], placements: ["S(0)", R]}
  fc1.weight: {shape: [32, 16], placements: [R, "S(0)"]}
  fc1.bias: {shape: [32], placements: [R, "S(0)"]}
  fc2.weight: {shape: [16, 32], placements: [R, "S(1)"]}
nodes:
  - {name: fc1, op: linear, inputs: [x, fc1.weight, fc1.bias]}
  - {name: act, op: gelu, inputs: [fc1]}
  - {name: fc2, op: linear, inputs: [act, fc2.weight]}
outputs: [fc2]
"""

#: each of 4 gloo processes: hyper-parallel on its torch platform, shard_module with the exported plan
HYPER_PARALLEL_WORKER = '''
import json, os, sys
import torch, torch.distributed as dist

os.environ["HYPER_PARALLEL_PLATFORM"] = "torch"
SNAPSHOT, PLAN_FILE, OUT, PORT = sys.argv[1:5]
sys.path.insert(0, SNAPSHOT)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def work(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from hyper_parallel import shard_module
    ns = {}
    exec(compile(open(PLAN_FILE).read(), PLAN_FILE, "exec"), ns)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    with torch.no_grad():
        reference = model(x)
    mesh = ns["make_mesh"]("cpu")
    model = shard_module(model, mesh, ns["sharding_plan"](mesh))
    with torch.no_grad():
        out = model(**ns["shard_inputs"](mesh, x=x))
        full = out.full_tensor()
    report = {"params": {n: [str(p) for p in t.placements] for n, t in model.named_parameters()},
              "local": {n: list(t.to_local().shape) for n, t in model.named_parameters()},
              "out": [repr(p) for p in out.placements], "err": float((full - reference).abs().max())}
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(work, args=(4,), nprocs=4)
'''


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_hyper_parallel_export_runs_on_its_torch_platform(tmp_path):
    """hyper-parallel's own shard_module, on its torch platform (the snapshot, 4 processes, gloo on CPU),
    with the exported sharding_plan: the parameters get layout-prop's placements, the output the layouts
    layout-prop predicts (S(0) on dp, a partial sum on tp) and, assembled, one device's values."""
    import json
    import subprocess
    import sys

    from layout_prop.commands.export import export_text
    from layout_prop.io.loader import load_spec

    if not (SNAPSHOT / "hyper_parallel").is_dir():
        pytest.skip(f"the shared hyper-parallel snapshot is not at {SNAPSHOT}")
    export, code = export_text(load_spec(LINEAR_MLP_SPEC), "hyper-parallel", data_inputs=["x"])
    assert "no output_plan" in code  # a partial output: hyper-parallel redistributes to no partial layout
    plan_file, worker = tmp_path / "hp_plan.py", tmp_path / "worker.py"
    plan_file.write_text(code)
    worker.write_text(HYPER_PARALLEL_WORKER)
    run = subprocess.run([sys.executable, str(worker), str(SNAPSHOT), str(plan_file), str(tmp_path),
                          str(_free_port())], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    want = {name: t.own_layout().placement_strs() for name, t in export.parameters.items()}  # "R", "S(0)" both sides
    for report in reports:
        assert report["params"] == want
        assert report["local"] == {"fc1.weight": [16, 16], "fc1.bias": [16], "fc2.weight": [16, 16]}
        assert export.outputs["fc2"].placement_strs() == ["S(0)", "P(sum)"]
        assert report["out"] == ["Shard(dim=0)", "Partial(reduce_op='sum')"]
        assert report["err"] < 1e-5
