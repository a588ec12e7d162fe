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

from layout_prop.workflows.search import analysed
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


def test_a_layer_s_activations_are_korthikanti_s_count():
    """The search keeps a layer's activations as Korthikanti et al. count them (not the generator graph's saved
    values): gen gpt on tp=2, no sequence parallelism, s=256, b=2, h=512: s b h (10 + 24 / 2) besides the core;
    gen llama (sequence parallel, SwiGLU ffn 1024, 2 of 8 kv heads, no dropout) on tp=2: the norms', QKV and MLP
    inputs 8, Q 2, K and V 4 x 2/8, the attention output 2, the MLP 3 x 2 x 1024/512 = 12: 25 s b h / 2."""
    from layout_prop.workflows.search import generator_spec

    s, b, h = 256, 2, 512
    gpt = ModelShape(family="gpt", layers=2, hidden=h, heads=8, ffn=4 * h, seq=s, dtype="float16", vocab=1024,
                     builder=generator_spec)
    layer, _, _ = LayerCache(gpt, get_cluster("a100-80g"), analysed).get(2, 1, 1, b)
    assert layer.activation_bytes - layer.attention_core_bytes == s * b * h * (10 + 24 / 2)
    llama = ModelShape(family="llama", layers=2, hidden=h, heads=8, kv_heads=2, ffn=2 * h, seq=s, dtype="float16",
                       vocab=1024, builder=generator_spec)
    layer, _, _ = LayerCache(llama, get_cluster("a100-80g"), analysed).get(2, 1, 1, b)
    assert layer.attention_core_bytes == 0  # fused attention
    assert layer.activation_bytes == s * b * h * (8 + 2 + 4 * 2 / 8 + 2 + 12) / 2
