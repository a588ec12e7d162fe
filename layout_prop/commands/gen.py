"""``layout-prop gen llama``: write the spec of a generated model."""

from __future__ import annotations

import sys

__all__ = ["run"]


def run(args) -> int:
    from layout_prop.io.loader import format_spec, load_spec
    from layout_prop.frontends.generate import llama_spec, parse_mesh_arg

    spec = llama_spec(args.layers, parse_mesh_arg(args.mesh), batch=args.batch, seq=args.seq, hidden=args.hidden,
                      heads=args.heads, ffn=args.ffn, dtype=args.dtype)
    load_spec(spec)  # never write a spec that check would refuse
    text = format_spec(spec, args.output)
    if args.output is None:
        print(text, end="")
    else:
        from layout_prop.io.output import write_output

        write_output(args.output, text)  # atomic: a full disk leaves no truncated spec
        print(f"wrote {args.output} ({len(spec['nodes'])} nodes)", file=sys.stderr)
    return 0
