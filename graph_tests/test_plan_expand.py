"""The planner prices the forms the expand pass writes (passes/expand.py): a cross entropy on
vocab-sharded logits is planned as Megatron's vocab-parallel cross entropy (an all-reduce of a max
and of three parts per token), not as an all-gather of the logits."""

import pytest

from layout_prop.workflows.plan import graph_to_spec, measure
from layout_prop.frontends.generate import llama_spec
from layout_prop.io.loader import load_spec
from layout_prop.planner.solver import realise, solve
from layout_prop.runner import run_graph

pytest.importorskip("scipy")

MESH = (("dp", 2), ("sp", 1), ("tp", 2))
BATCH, SEQ, VOCAB = 2, 8, 512


def _ce_spec() -> dict:
    """``gen llama --full`` (1 layer, dp=2 x tp=2, vocab 512) with its loss as one ``cross_entropy`` node, as an
    imported model writes it (the generator writes the vocab-parallel form itself); the output head pinned
    vocab-parallel, ``(R, R, S(0))``, every other weight ``auto``."""
    spec = llama_spec(1, MESH, full=True, vocab=VOCAB)
    nodes = [n for n in spec["nodes"] if n["name"] not in ("logits_max", "loss_parts", "loss")]
    nodes.append({"name": "loss", "op": "cross_entropy", "inputs": ["logits", "labels"], "attrs": {}})
    spec["nodes"] = nodes
    assert spec["inputs"]["lm_head.weight"]["placements"] == ["R", "R", "S(0)"]
    for name, inp in spec["inputs"].items():
        if name not in ("tokens", "labels", "cos", "sin", "lm_head.weight"):
            inp["placements"] = "auto"
    return spec


def _planned(expansions: bool):
    graph = load_spec(_ce_spec())
    solution = solve(graph, expansions=expansions)
    planned = graph.copy_structure()
    for node in planned.inputs():
        node.attrs["placements"] = solution.layouts[node.name]
    realised, _ = realise(planned, solution.strategies)
    return solution, realised


@pytest.fixture(scope="module")
def plans():
    return {flag: _planned(flag) for flag in (True, False)}


def _logits_moves(realised):
    """The redistributions of the value ``logits`` in the realised graph resolved as ``check --reshard``."""
    from layout_prop.api import analyze

    resolved = analyze(realised.copy_structure(), reshard=True, backward=True)
    return [r for r in resolved.check.redistributions if r.input == "logits"], resolved


def test_the_solver_chooses_the_vocab_parallel_cross_entropy(plans):
    solution, realised = plans[True]
    strategy = solution.strategies["loss"]
    assert strategy.expanded
    assert strategy.inputs[0].placement_strs()[2] == "S(2)"  # the logits received sharded on the classes
    loss = realised.node("loss")
    assert loss.op == "cross_entropy" and loss.inputs[0] == "logits"  # no move written before it
    moves, resolved = _logits_moves(realised)
    assert moves == []
    assert any("loss (cross_entropy) written as" in note for note in resolved.notes)


def test_without_the_expansion_the_logits_are_gathered(plans):
    solution, realised = plans[False]
    assert not solution.strategies["loss"].expanded
    moves, _ = _logits_moves(realised)
    # the hand count: an all-gather on tp (2 ranks) of float32 logits (2, 8, 512) sharded on the classes
    # receives the other half, 2 * 8 * 256 * 4 bytes per rank
    assert [(s.kind, s.bytes_per_rank) for r in moves for s in r.plan.steps] == [("all-gather", 2 * 8 * 256 * 4)]


def test_the_solver_prices_what_is_measured(plans):
    """The expansion is priced as the measurement of the realised plan finds it: the model's saving is the
    measured saving, and the measured saving is at least the logits' all-gather less the parts' all-reduces."""
    measured = {flag: measure(load_spec(graph_to_spec(realised)))["bytes_per_step"]
                for flag, (_, realised) in plans.items()}
    modelled = {flag: solution.cost for flag, (solution, _) in plans.items()}
    saving = measured[False] - measured[True]
    assert saving == modelled[False] - modelled[True]
    # the all-reduces of the vocab-parallel form on tp: a max and three parts per token of a rank's 8 tokens
    # (dp shards the batch), forward, and a sum of the cotangent pieces: below 1 KiB
    assert saving >= 2 * 8 * 256 * 4 - 1024


def test_the_planned_spec_runs_like_one_device(plans):
    _, realised = plans[True]
    report = run_graph(load_spec(graph_to_spec(realised)), backward=True)
    assert report.ok, report
