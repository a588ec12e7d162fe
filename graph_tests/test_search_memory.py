"""The search's activation memory per layer against a hand count.

Selective recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022) frees the attention's (batch, heads, seq, seq) values that the
backward reads, the probabilities, and keeps the rest of a layer's saved activations (their
34 sbh bytes a layer in fp16).  The search subtracted every (batch, heads, seq, seq) value,
the scores before the softmax too, so a 530B GPT layer kept 6.4 sbh instead of 32, and
ZeRO-3 pure data parallelism of 105 such layers looked as if it fit 80 GB.  The layers here
are benchmarks/estimate_megatron.py's (Megatron-LM's 2021 GPT, attention unfused, as the
search's published-configuration benchmark prices them).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

from layout_prop.commands.search import analysed
from layout_prop.perf.clusters import get_cluster
from layout_prop.planner.search import LayerCache, ModelShape

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "estimate_megatron.py"


def _megatron():
    spec = importlib.util.spec_from_file_location("estimate_megatron_for_tests", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_selective_recomputation_frees_the_probabilities_only():
    mega = _megatron()
    hidden, heads, seq = 512, 8, mega.SEQ
    row = mega.Row(name="test", heads=heads, hidden=hidden, layers=2, tp=1, pp=1, gpus=1, batch=1, tflops=0.0)

    def build(model, layers, tp, cp=1, ep=1, dp=1, micro_batch=1, dense=None):
        return mega.gpt_spec(dataclasses.replace(row, tp=tp, gpus=dp * tp), micro_batch, layers)

    model = ModelShape(family="gpt", layers=2, hidden=hidden, heads=heads, ffn=4 * hidden, seq=seq,
                       dtype="float16", vocab=mega.VOCAB, builder=build)
    layer, _, _ = LayerCache(model, get_cluster("a100-80g"), analysed).get(1, 1, 1, 1)
    probabilities = 1 * heads * seq * seq * 2  # one (batch, heads, seq, seq) float16 tensor, micro-batch 1
    # the softmax's output and the attention dropout's (Korthikanti et al.'s 2 a s^2 b and 2 a s^2 b; the dropout
    # mask, their a s^2 b, is regenerated from the seed here)
    assert layer.attention_core_bytes == 2 * probabilities
    kept = layer.activation_bytes - layer.attention_core_bytes
    sbh = seq * 1 * hidden
    # a GPT layer's saved activations besides the attention core, in fp16 bytes a (s, b, h) element: at least
    # the two norms' inputs (2 + 2), q, k, v (6), the attention output (2), the MLP's input (2), the 4h-wide
    # fc1 and GELU outputs (8 + 8): 30 sbh; Korthikanti et al. count 34 with the dropout masks
    assert 30 * sbh <= kept <= 40 * sbh, kept / sbh
