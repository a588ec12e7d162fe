"""Write the tiny real-model fixtures of the importer's tests (issue #29): run by hand, outside CI.

Each model is a randomly initialised Hugging Face model (2 layers, hidden 64, vocabulary 128,
seed 0: Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, BERT and T5) exported to ONNX by torch's
exporters (dynamo; BERT and the whole T5 encoder-decoder with the TorchScript exporter: the
dynamo exporter wrote T5's dropout in training mode), beside the output torch computed for
the token ids the tests feed it (``NAME.npz``: ``input_ids``, T5's ``decoder_input_ids``, and
``logits``, or ``last_hidden_state`` for BERT; at most 5 MB in all).  torch and transformers
are not dependencies of layout-prop and are never needed by the tests, which read the
committed files; to write the files again::

    python3 -m venv /tmp/venv-torch
    /tmp/venv-torch/bin/pip install torch==2.13.0 transformers==5.25.0 onnx==1.23.2 onnxscript==0.7.2
    /tmp/venv-torch/bin/python examples/models/make_fixtures.py [NAME...]

The versions are those the committed files were written with (``VERSIONS``, checked at start).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

VERSIONS = {"torch": "2.13.0", "transformers": "5.25.0", "onnx": "1.23.2", "onnxscript": "0.7.2"}
OUT = Path(__file__).resolve().parent
SEQ = 8
VOCAB = 128


def check_versions() -> None:
    import importlib

    for name, want in VERSIONS.items():
        have = importlib.import_module(name).__version__.split("+")[0]
        if have != want:
            sys.exit(f"{name} {have} is installed; the fixtures are written with {want} (see VERSIONS)")


def configs():
    """(name, model class, config, exporter) of every fixture."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, use_cache=False)
    decoder = dict(common, intermediate_size=128, max_position_embeddings=64)
    return [
        ("llama", tf.LlamaForCausalLM, tf.LlamaConfig(**decoder, num_key_value_heads=2), "dynamo"),
        ("qwen2", tf.Qwen2ForCausalLM, tf.Qwen2Config(**decoder, num_key_value_heads=2), "dynamo"),
        ("mistral", tf.MistralForCausalLM, tf.MistralConfig(**decoder, num_key_value_heads=2), "dynamo"),
        ("gemma", tf.GemmaForCausalLM, tf.GemmaConfig(**decoder, num_key_value_heads=2, head_dim=16), "dynamo"),
        ("phi3", tf.Phi3ForCausalLM, tf.Phi3Config(**decoder, num_key_value_heads=4, pad_token_id=0), "dynamo"),
        ("gpt2", tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                   use_cache=False), "dynamo"),
        ("bert", tf.BertModel, tf.BertConfig(**dict(common, intermediate_size=128, max_position_embeddings=64)),
         "dynamo"),
        ("bert_torchscript", tf.BertModel,
         tf.BertConfig(**dict(common, intermediate_size=128, max_position_embeddings=64)), "torchscript"),
        # the whole encoder-decoder; heads of 8 and a feed-forward of 32 keep it in the size bound
        ("t5_torchscript", tf.T5ForConditionalGeneration,
         tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=32, num_layers=2, num_heads=4, use_cache=False,
                     decoder_start_token_id=0), "torchscript"),
    ]


def export(name, cls, config, exporter) -> int:
    import torch

    torch.manual_seed(0)
    model = cls(config).eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    feeds = {"input_ids": ids}
    if config.is_encoder_decoder:  # T5: the decoder's token ids too
        feeds["decoder_input_ids"] = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(**feeds)
    key = "logits" if hasattr(out, "logits") else "last_hidden_state"
    path = OUT / f"{name}.onnx"
    if exporter == "dynamo":
        program = torch.onnx.export(model, (ids,), dynamo=True, optimize=True)
        program.save(str(path))
    else:
        class Outputs(torch.nn.Module):  # the tracer takes a tensor out, not a ModelOutput
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, *ids):
                return getattr(self.inner(**dict(zip(feeds, ids))), key)

        torch.onnx.export(Outputs(model), tuple(feeds.values()), str(path), dynamo=False, input_names=list(feeds),
                          output_names=[key], opset_version=17)
    arrays = {**{k: v.numpy() for k, v in feeds.items()}, key: getattr(out, key).numpy()}
    np.savez_compressed(OUT / f"{name}.npz", **arrays)
    return path.stat().st_size


def main(names: list[str]) -> None:
    """Write every fixture, or those named."""
    check_versions()
    for name, cls, config, exporter in configs():
        if not names or name in names:
            size = export(name, cls, config, exporter)
            print(f"{name}: {size:,} bytes ({exporter} exporter)")
    total = sum(p.stat().st_size for p in OUT.glob("*.onnx")) + sum(p.stat().st_size for p in OUT.glob("*.npz"))
    print(f"total {total:,} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
