"""Rules of the attention op family: flash_attention_score (MindSpore's fused attention) and context-parallel attention."""
