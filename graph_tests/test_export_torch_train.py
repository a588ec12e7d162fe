"""The torch export, executed as training: ``gen llama --full`` exported with ``export --to torch`` and
trained one step (forward, loss, backward, SGD step) on 4 processes with gloo on CPU equals one process:
the loss and every parameter after the step. tp + dp with sequence parallelism (the plan's DTensor
placements, the vocabulary-parallel embedding settled by hand) and ZeRO-3 (FSDP2 ``fully_shard`` over dp)
with tensor parallelism.

torch is optional: skipped without it (``pip install -e '.[torch]'``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is optional: pip install -e '.[torch]'")
pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")

from layout_prop.commands.export import export_text  # noqa: E402
from layout_prop.frontends.generate import llama_spec  # noqa: E402
from layout_prop.io.loader import load_spec  # noqa: E402

WORLD = 4


def _export(spec: dict) -> str:
    _, code = export_text(load_spec(spec), "torch", source="llama.yaml")
    return code


def _start(fn, args) -> None:
    """``fn(rank, *args)`` on WORLD fresh processes: forked from a forkserver (torch imported there once), not
    from pytest's process, whose torch state (an earlier test's fake process group) a fork would inherit."""
    import multiprocessing

    import torch.multiprocessing as mp

    try:
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "graph_tests.torch_gen_llama"])
    except (ValueError, RuntimeError):
        pass
    mp.start_processes(fn, args=args, nprocs=WORLD, start_method="forkserver")


def _train(tmp_path, spec: dict, code: str):
    from graph_tests.torch_gen_llama import worker

    out = tmp_path / "rank0.pt"
    _start(worker, (WORLD, str(tmp_path / "store"), spec, code, str(out)))
    return torch.load(out)


def _compare(result, spec):
    from graph_tests.torch_gen_llama import reference

    loss, params = reference(spec)
    assert abs(result["loss"] - loss) < 1e-5, (result["loss"], loss)
    assert sorted(result["params"]) == sorted(params)
    for name, value in params.items():
        torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _spec(mesh=(("dp", 2), ("sp", 1), ("tp", 2)), **config) -> dict:
    spec = llama_spec(layers=1, mesh=mesh, batch=4, seq=8, hidden=32, heads=4, ffn=64, full=True, vocab=64)
    spec.update(config)
    return spec


def test_tp_dp_sequence_parallel_step_equals_one_process(tmp_path):
    spec = _spec(recompute="full")
    code = _export(spec)
    assert "MESH_DIM_NAMES = ('dp', 'tp')" in code  # sp (size 1) left out
    assert "'embedded': (Shard(0), " in code and "RECOMPUTE = 'full'" in code
    _compare(_train(tmp_path, spec, code), spec)


def test_zero3_fsdp_with_tp_step_equals_one_process(tmp_path):
    spec = _spec(zero={"stage": 3})
    code = _export(spec)
    assert "ZERO_STAGE = 3" in code and "MODEL_AXES = ('tp',)" in code
    _compare(_train(tmp_path, spec, code), spec)


def test_the_searchs_7b_plan_shape_dp_zero3_step_equals_one_process(tmp_path):
    """plan --search's best for a Llama-2-7B shape on 64 A100s is dp=64 x sp=1 x tp=1 with ZeRO-3 (docs/export.md):
    the same configuration at a toy size on 4 processes, dp=4: the sp and tp axes (size 1) are left out, every
    parameter is a plain tensor fully_shard shards over dp, and the step equals one process."""
    spec = _spec(mesh=(("dp", 4), ("sp", 1), ("tp", 1)), zero={"stage": 3, "axes": ["dp"]},
                 training={"global_batch": 8, "micro_batch": 1})
    code = _export(spec)
    for line in ("MESH_DIM_NAMES = ('dp',)", "ZERO_STAGE = 3", "MODEL_AXES = ()", "MICRO_BATCHES = 2",
                 "GLOBAL_BATCH = 8"):
        assert line in code.splitlines(), line
    _compare(_train(tmp_path, spec, code), spec)


def test_the_hugging_face_llama_fixture_trains_with_styles_and_zero3(tmp_path):
    """The tiny Hugging Face Llama of the fixtures (examples/models/llama.onnx, as graph_tests/test_export_torch.py
    mirrors it in torch with the fixture's weights), imported with a Megatron plan on dp=2 x tp=2 and the spec's
    ZeRO-3: the export's parallelize_module styles on tp, then fully_shard over dp; one SGD step of next-token
    cross entropy on 4 gloo processes equals one process (the batch is replicated: the fixture's batch is 1)."""
    import numpy as np

    from graph_tests import test_export_torch as fx
    from graph_tests.torch_gen_llama import fixture_step, fixture_worker
    from layout_prop.frontends import build_graph, read_model
    from layout_prop.io.plan_file import load_plan

    torch.manual_seed(0)
    model = fx.Llama()
    fx._load_fixture(model, fx._weights(tmp_path))
    plan = load_plan(fx.PLAN)
    graph = build_graph(read_model(fx.MODEL, plan), plan)
    graph.meta["zero"] = {"stage": 3}
    _, code = export_text(graph, "torch", source=fx.MODEL.name)
    assert "ZERO_STAGE = 3" in code and "TP_AXIS = 'tp'" in code
    ids = torch.from_numpy(np.load(fx.ROOT / "examples" / "models" / "llama.npz")["input_ids"])
    torch.save(model.state_dict(), tmp_path / "state.pt")
    torch.save(ids, tmp_path / "ids.pt")
    out = tmp_path / "rank0.pt"
    _start(fixture_worker, (WORLD, str(tmp_path / "store"), code, str(tmp_path / "state.pt"), str(tmp_path / "ids.pt"),
                            str(out)))
    result = torch.load(out)
    loss = fixture_step(model, ids)
    assert abs(result["loss"] - float(loss.detach())) < 1e-5
    for name, value in model.named_parameters():
        torch.testing.assert_close(result["params"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
