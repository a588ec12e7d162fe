"""Rules of the copying op family: pad, expand, repeat_interleave, full_like, stack, unbind."""
