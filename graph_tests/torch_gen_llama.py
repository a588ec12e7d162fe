"""A torch module of ``gen llama --full`` (parameters and buffers by gen's names, from the spec's shapes) and
the multi-process worker that trains it one step with the plan ``export --to torch`` wrote.

Used by graph_tests/test_export_torch_train.py; imported only where torch is installed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-6


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def like(value, ref):
    """``value`` (a plain tensor) replicated on ``ref``'s mesh when ``ref`` is a DTensor: DTensors mix with none."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(ref, DTensor):
        return value
    return DTensor.from_local(value, ref.device_mesh, [Replicate()] * ref.device_mesh.ndim, run_check=False)


def rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def roles(spec: dict) -> dict:
    """The spec's parameter names by role, read from the nodes that use them (whatever gen names them):
    ``embed``, ``final_norm``, ``head`` and ``layers`` (layer index -> role -> name: norm1, q, k, v, o, norm2,
    gate, up, down, in graph order of the layer's rms_norm and linear nodes)."""
    out: dict = {"layers": {}}
    norms, linears = [], []
    for node in spec["nodes"]:
        layer = node["name"].split("_")[0]
        inside = layer[0] == "l" and layer[1:].isdigit()
        if node["op"] == "embedding":
            out["embed"] = node["inputs"][1]
        elif node["op"] in ("rms_norm", "linear") and inside:
            named = out["layers"].setdefault(int(layer[1:]), {})
            kinds = ("norm1", "norm2") if node["op"] == "rms_norm" else ("q", "k", "v", "o", "gate", "up", "down")
            named[kinds[sum(k in named for k in kinds)]] = node["inputs"][1]
        elif node["op"] == "rms_norm":
            norms.append(node["inputs"][1])
        elif node["op"] == "linear":
            linears.append(node["inputs"][1])
    out["final_norm"], out["head"] = norms[-1], linears[-1]
    return out


def _holder(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module holding the (possibly dotted) tensor ``name`` under ``root``, made of plain modules, and its leaf."""
    module = root
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module, leaf


class GenLlama(torch.nn.Module):
    """``gen llama --full``: the spec's inputs that take a gradient are parameters under the spec's names
    (dotted names as nested modules), cos and sin buffers; ``forward(tokens, labels)`` is the mean next-token
    cross entropy.

    ``plan`` is the exported module's namespace (``settle``, ``recompute``), or None on one process. ``chunk``
    (an entry of the exported ``CHUNKS``) makes the module one pipeline chunk: it holds that chunk's parameters
    only (equal to the whole model's), and ``forward(x)`` takes the token ids (first chunk) or the residual
    stream and returns the residual stream or (last chunk) the logits."""

    def __init__(self, spec: dict, plan: dict | None = None, chunk: dict | None = None):
        super().__init__()
        self.plan, self.chunk = plan, chunk
        self.roles = roles(spec)
        self.layers = sorted(self.roles["layers"]) if chunk is None else list(chunk["layers"])
        self.heads = next(n for n in spec["nodes"] if n["name"] == "l0_q_heads")["attrs"]["shape"][2]
        keep = None if chunk is None else set(chunk["parameters"])
        gen = torch.Generator().manual_seed(0)
        for name, entry in spec["inputs"].items():
            if entry.get("dtype", "float32").startswith("int") or entry.get("requires_grad", True) is False:
                continue
            shape = entry["shape"]
            if len(shape) == 1:  # a norm's weight
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
            if keep is None or name in keep:
                module, leaf = _holder(self, name)
                module.register_parameter(leaf, torch.nn.Parameter(value))
        seq, head_dim = spec["inputs"]["cos"]["shape"][2:]
        inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        emb = torch.cat([torch.outer(torch.arange(seq, dtype=torch.float32), inv)] * 2, dim=-1)
        self.register_buffer("cos", emb.cos()[None, None])
        self.register_buffer("sin", emb.sin()[None, None])

    def _p(self, name):
        module, leaf = _holder(self, name)
        return getattr(module, leaf)

    def _settle(self, name, x):
        return self.plan["settle"](name, x) if self.plan else x

    def _layer(self, i, x):
        p = lambda role: self._p(self.roles["layers"][i][role])  # noqa: E731
        b, s, hidden = x.shape
        hd = hidden // self.heads
        h = rms_norm(x, p("norm1"))
        q, k, v = (F.linear(h, p(w)).view(b, s, -1, hd).transpose(1, 2) for w in ("q", "k", "v"))
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        mask = torch.full((s, s), float("-inf")).triu(1)
        attn = torch.softmax(scores + like(mask, scores), dim=-1) @ v  # torch's CPU sdpa has no DTensor rule
        x = x + F.linear(attn.transpose(1, 2).reshape(b, s, hidden), p("o"))
        h2 = rms_norm(x, p("norm2"))
        return x + F.linear(F.silu(F.linear(h2, p("gate"))) * F.linear(h2, p("up")), p("down"))

    def _run(self, x):
        """The token ids or residual stream ``x`` through this module's part: the residual stream or the logits."""
        params = None if self.chunk is None else set(self.chunk["parameters"])
        if params is None or self.roles["embed"] in params:
            x = self._settle("embedded", F.embedding(x, self._p(self.roles["embed"])))
        for i in self.layers:
            if self.plan:
                x = self.plan["recompute"](f"l{i}", lambda y, i=i: self._layer(i, y), x)
            else:
                x = self._layer(i, x)
        if params is None or self.roles["head"] in params:
            x = F.linear(rms_norm(x, self._p(self.roles["final_norm"])), self._p(self.roles["head"]))
        return x

    def forward(self, *args):
        if self.chunk is not None:
            return self._run(*args)
        tokens, labels = args
        return lm_loss(self._run(tokens), labels)


def lm_loss(logits, labels):
    """The mean next-token cross entropy of ``logits`` ``(B, S, V)`` against ``labels`` ``(B, S)``."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(spec: dict):
    gen = torch.Generator().manual_seed(1)
    b, s = spec["inputs"]["tokens"]["shape"]
    vocab = spec["inputs"][roles(spec)["embed"]]["shape"][0]
    return torch.randint(0, vocab, (b, s), generator=gen), torch.randint(0, vocab, (b, s), generator=gen)


def one_step(model, tokens, labels, lr=0.1):
    """Forward, loss, backward, SGD step: the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = model(tokens, labels)
    loss.backward()
    opt.step()
    return loss


def reference(spec: dict):
    """One process: the loss and every parameter after one step."""
    model = GenLlama(spec)
    tokens, labels = batch(spec)
    loss = one_step(model, tokens, labels)
    return float(loss.detach()), {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(rank: int, world: int, store: str, spec: dict, code: str, out: str):
    """One rank: the exported plan applied to the model, one training step, rank 0 saves the loss and the
    parameters (full tensors) to ``out``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        plan: dict = {}
        exec(compile(code, "exported_plan.py", "exec"), plan)
        mesh = plan["make_mesh"]("cpu")
        model = plan["parallelize"](GenLlama(spec, plan), mesh)
        tokens, labels = batch(spec)
        loss = one_step(model, **plan["shard_inputs"](mesh, tokens=tokens, labels=labels))
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        if plan["ZERO_STAGE"]:  # each data-parallel rank's loss is its own batch's mean (equal on its
            loss = loss.detach().clone()  # model-parallel ranks): the mean over every rank is the batch's
            dist.all_reduce(loss)
            loss = loss / world
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": float(loss), "params": params}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fixture_worker(rank: int, world: int, store: str, code: str, state: str, ids_path: str, out: str):
    """One rank of the Hugging Face Llama fixture's mirror (graph_tests/test_export_torch.py's ``Llama``) with
    the exported plan (parallelize_module's styles, then ZeRO): one SGD step on next-token cross entropy; rank 0
    saves the loss and every parameter (full tensors) to ``out``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from graph_tests.test_export_torch import Llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        plan: dict = {}
        exec(compile(code, "exported_plan.py", "exec"), plan)
        model = Llama()
        model.load_state_dict(torch.load(state))
        ids = torch.load(ids_path)
        mesh = plan["make_mesh"]("cpu")
        model = plan["parallelize"](model, mesh)
        loss = fixture_step(model, plan["shard_inputs"](mesh, input_ids=ids)["input_ids"])
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": float(loss.detach()), "params": params}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fixture_step(model, ids, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss


#: how a rank trains one step with a pipelined plan (docs/export.md shows the same lines; its test runs the page's)
PIPELINE_USAGE = """
mesh = make_mesh()
modules = {c: MyChunk(CHUNKS[c]) for c in stage_chunks(mesh)}
schedule = pipeline(modules, mesh, loss_fn)
optimizer = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1)
losses = pipeline_step(schedule, mesh, tokens=tokens, labels=labels)
optimizer.step()
"""


def pipeline_worker(rank: int, world: int, store: str, spec: dict, code: str, out: str, usage: str = PIPELINE_USAGE):
    """One rank of a pipelined plan: ``usage`` run in the exported module's namespace (this rank's chunk modules
    ``MyChunk(CHUNKS[c])`` for ``stage_chunks``, the exported ``pipeline``, one ``pipeline_step`` and an SGD
    step, ``loss_fn`` the mean cross entropy); each rank of coordinate 0 on the other axes saves its chunks'
    parameters (full tensors) and, on the last stage, the step's loss (the mean of the micro-batches') to
    ``out/rank<r>.pt``."""
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        plan: dict = {}
        exec(compile(code, "exported_plan.py", "exec"), plan)
        tokens, labels = batch(spec)
        scope = dict(plan, torch=torch, loss_fn=lm_loss, tokens=tokens, labels=labels,
                     MyChunk=lambda chunk: GenLlama(spec, plan, chunk))
        exec(compile(usage, "usage.py", "exec"), scope)
        mesh, modules, losses = scope["mesh"], scope["modules"], scope["losses"]

        def full(t):
            return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

        params = {n: full(p) for m in modules.values() for n, p in m.named_parameters()}
        # the step's loss: the mean of the micro-batches' on a last-stage rank, averaged over the last stage's ranks
        # (each data-parallel rank's is its own batch's with ZeRO; equal on every rank otherwise)
        mine = torch.zeros(2)
        if losses is not None:
            mine += torch.tensor([float(sum(full(x) for x in losses) / len(losses)), 1.0])
        dist.all_reduce(mine)
        loss = float(mine[0] / mine[1]) if losses is not None else None
        others = [name for name in plan["MESH_DIM_NAMES"] if name != plan["PP_AXIS"]]
        if all(mesh[name].get_local_rank() == 0 for name in others):
            torch.save({"loss": loss, "params": params, "chunks": sorted(modules)}, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
