"""``run`` judges an expanded node against the graph as written, not against its own expansion.

The expand pass writes some nodes as their rule's subgraph (ring attention, vocabulary-parallel
cross entropy, top-k and cumsum along a sharded dim).  ``run_graph`` compared the ranks with a
one-device execution of the *expanded* graph, so a wrong expansion (a wrong merge kernel, a
wrong mask) was computed the same wrong way on both sides and the run said "matches one
device".  The reference is now the graph analysed without resharding, which holds no expansion.
Each case breaks one kernel that only the expansion uses and expects a mismatch.
"""

from __future__ import annotations

import numpy as np
import pytest

from layout_prop.api import analyze
from layout_prop.io.loader import load_spec
from layout_prop.kernels.numpy_backend import KERNELS
from layout_prop.runner import run_graph

RING = {"mesh": {"shape": [4], "names": ["cp"]},
        "inputs": {name: {"shape": [2, 2, 8, 4], "placements": ["S(2)"], "dtype": "float64"} for name in "qkv"},
        "nodes": [{"name": "attn", "op": "scaled_dot_product_attention", "inputs": ["q", "k", "v"],
                   "attrs": {"context_parallel": "ring", "causal": True}}],
        "outputs": ["attn"]}
TOPK = {"mesh": {"shape": [4], "names": ["tp"]},
        "inputs": {"x": {"shape": [6, 40], "placements": ["S(1)"], "dtype": "float64"}},
        "nodes": [{"name": "top", "op": "topk", "inputs": ["x"], "attrs": {"k": 2}}],
        "outputs": ["top:0", "top:1"]}


def _scaled(kernel):
    def wrong(*args, **kwargs):
        out = kernel(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o * 1.5 if np.issubdtype(np.asarray(o).dtype, np.floating) else o for o in out)
        return out * 1.5
    return wrong


@pytest.mark.parametrize("spec, broken, backward", [(RING, "attention_merge", True), (TOPK, "topk_merge", False)],
                         ids=["ring-merge", "topk-merge"])
def test_a_wrong_expansion_kernel_is_a_mismatch(spec, broken, backward, monkeypatch):
    assert analyze(load_spec(spec), reshard=True).expanded  # the case does take its expansion
    right = run_graph(load_spec(spec), backward=backward)
    assert right.ok, right.mismatches
    monkeypatch.setitem(KERNELS, broken, _scaled(KERNELS[broken]))
    wrong = run_graph(load_spec(spec), backward=backward)
    assert not wrong.ok and wrong.mismatches


def test_a_graph_without_expansion_keeps_its_own_reference(monkeypatch):
    """Only an expanded graph is analysed a second time (without resharding) for its reference."""
    import layout_prop.api as api

    calls = []
    real = api.analyze
    monkeypatch.setattr(api, "analyze", lambda graph, **kw: calls.append(kw["reshard"]) or real(graph, **kw))
    plain = {**RING, "nodes": [{**RING["nodes"][0], "attrs": {"causal": True}}]}  # all_gather: nothing expanded
    assert not real(load_spec(plain), reshard=True).expanded
    assert run_graph(load_spec(plain), backward=True).ok
    assert calls == [True]
    calls.clear()
    assert run_graph(load_spec(RING), backward=True).ok
    assert calls == [True, False]  # the ring's reference: the graph as written


def test_run_says_when_an_asked_form_was_not_taken(tmp_path):
    """A ring asked for on sequences the ranks do not divide gathers instead: run's report says so in a
    note line (check said it; run printed no note before)."""
    import json
    import subprocess

    from .cli_support import cli_env, console_command

    spec = json.loads(json.dumps(RING))
    for name in "kv":
        spec["inputs"][name]["shape"] = [2, 2, 6, 4]  # 6 keys on 4 ranks: no ring
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([*console_command(), "run", str(path)], capture_output=True, text=True, env=cli_env())
    assert proc.returncode == 0, proc.stderr
    assert ("note: expand: attn (scaled_dot_product_attention, context_parallel='ring') gathers k and v instead"
            in proc.stdout)


def test_a_wrong_expansion_is_a_mismatch_with_a_recompute_block_too(monkeypatch, tmp_path, capsys):
    """With a zero: or recompute: block, run compares with the spec analysed without the blocks; that
    reference was resharded, so it held the ring itself (found in review): now it is the graph as written."""
    import json

    from layout_prop.cli import main

    spec = {**RING, "recompute": {"mode": "full"}}
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(spec))
    assert main(["run", str(path), "--backward"]) == 0
    monkeypatch.setitem(KERNELS, "attention_merge", _scaled(KERNELS["attention_merge"]))
    assert main(["run", str(path), "--backward"]) == 1
    assert "does NOT match one device" in capsys.readouterr().out
