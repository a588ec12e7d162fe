"""``layout-prop audit PATH``: judge a hyper-parallel checkout's sharding rules by execution."""

from __future__ import annotations

import argparse
from pathlib import Path

from .printing import print_json
from .flags import RUNS_CODE, mesh_arg, non_negative_int, positive_int, time_limit_arg

__all__ = ["add_parser", "run"]


def _print_finding(kind: str, finding) -> None:
    print(f"  {kind.replace('_', '-')} reproducer (mesh {'x'.join(map(str, finding.mesh.shape))}, "
          f"{finding.case.describe()}):")
    for line in finding.upstream_code().splitlines():
        print(f"      {line}")
    print(f"    hyper-parallel: {finding.upstream_answer}")
    print(f"    layout-prop:    {finding.ours}")
    if finding.message:
        print(f"    {finding.message}")


def _op_line(audit) -> str:
    c = audit.counts
    by = audit.op if "interop/judges.py" in audit.op else f"layout-prop {audit.op}"
    if audit.failure is not None:
        kind, message = audit.failure
        return f"{audit.name} ({by}): {kind}: {message}"
    return (f"{audit.name} ({by}): {audit.combinations} combinations: accepted "
            f"{audit.accepted} (right {c['right']}, wrong {c['wrong']} ({audit.silent} silently), unjudged "
            f"{c['unjudged']}), rejected "
            f"{c['rejected'] + c['over_strict']} (over-strict {c['over_strict']})")


def _print_report(report) -> None:
    meshes = ", ".join("x".join(map(str, m)) for m in report.meshes)
    print(f"audit of {report.root} on meshes {meshes} (platform layer: {report.platform})")
    for audit in report.ops:
        print(_op_line(audit))
        if audit.failure is not None:
            continue
        for reason, n in sorted(audit.unjudged_reasons.items()):
            print(f"  unjudged {n}: {reason}")
        for kind in ("wrong", "over_strict"):
            if kind in audit.examples:
                _print_finding(kind, audit.examples[kind])
    if report.not_mapped:
        print(f"not mapped ({len(report.not_mapped)}):")
        for name, reason in sorted(report.not_mapped.items()):
            print(f"  {name}: {reason}")
    t = report.totals()
    print(f"total: {t['combinations']} combinations, right {t['right']}, wrong {t['wrong']} "
          f"({t['wrong_silently']} silently), over-strict "
          f"{t['over_strict']}, rejected {t['rejected']}, unjudged {t['unjudged']}")
    failures = report.failures()
    if failures:
        print(f"not audited: {', '.join(f'{kind} {n}' for kind, n in failures.items())} "
              f"(ops whose rules crashed, hung, failed to load or answered no Layout)")
    if t["wrong"]:
        print("WRONG answers found")
    elif failures:
        print("some ops could not be audited")
    elif t["unjudged"]:  # an answer that could not be executed is no evidence that it is right
        print(f"no wrong answer found, but {t['unjudged']} accepted answers could not be judged")
    elif not t["combinations"]:  # every op named is not mapped: "all right" would be vacuous
        print("no combination audited: nothing was judged")
    else:
        print("every accepted answer is right")


def _escape(name: str) -> str:
    """An op name in a markdown cell (``__and__`` would turn bold)."""
    name = name.replace("|", "\\|")
    return name.replace("_", "\\_") if name.startswith("_") else name


def markdown(report) -> str:
    """The per-op table and the totals, as docs/audit.md shows them (``audit --markdown``)."""
    lines = ["| upstream op | executed with | tried | right | wrong (silently) | over-strict | rejected | unjudged |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for a in report.ops:
        if a.failure is not None:
            lines.append(f"| {_escape(a.name)} | {a.op} | {a.failure[0]} | | | | | |")
            continue
        c = a.counts
        lines.append(f"| {_escape(a.name)} | {a.op} | {a.combinations} | {c['right']} | {c['wrong']} ({a.silent}) | "
                     f"{c['over_strict']} | {c['rejected']} | {c['unjudged']} |")
    t = report.totals()
    judged = [a for a in report.ops if a.failure is None]
    lines.append(f"| **total ({len(report.ops)} ops)** | | {t['combinations']:,} | {t['right']:,} | "
                 f"{t['wrong']:,} ({t['wrong_silently']:,}) | {t['over_strict']:,} | {t['rejected']:,} | "
                 f"{t['unjudged']:,} |")
    wrong_ops = sum(1 for a in judged if a.counts["wrong"])
    strict_ops = sum(1 for a in judged if a.counts["over_strict"])
    all_right = [a for a in judged if not a.counts["wrong"]]
    exact = sum(1 for a in all_right if not a.counts["over_strict"])
    meshes = " and ".join("x".join(map(str, m)) for m in report.meshes)
    lines += ["", f"{len(report.ops)} ops audited on meshes {meshes}: {t['combinations']:,} combinations; "
              f"right {t['right']:,}; wrong {t['wrong']:,} ({t['wrong_silently']:,} of them silently) in "
              f"{wrong_ops} ops; over-strict {t['over_strict']:,} in {strict_ops} ops; rejected {t['rejected']:,}; "
              f"unjudged {t['unjudged']:,}. {len(all_right)} ops answer right on every combination they accept "
              f"({exact} of them refuse none that layout-prop's answer shows they could take)."]
    failures = report.failures()
    if failures:
        lines.append("Not audited: " + ", ".join(f"{kind} {n}" for kind, n in failures.items()) + ".")
    if report.not_mapped:
        lines.append(f"Not mapped: {', '.join(_escape(n) for n in sorted(report.not_mapped))}.")
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop audit``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("audit", help="judge a hyper-parallel checkout's sharding rules by execution",
                            epilog=RUNS_CODE)
    parser.add_argument("path", metavar="PATH", type=Path,
                        help="a hyper-parallel checkout (the folder holding hyper_parallel/); its package is imported, "
                             "so its code RUNS with your permissions")
    parser.add_argument("--op", action="append", metavar="NAME", help="an upstream op name (repeatable; default all)")
    parser.add_argument("--module", type=Path, action="append", metavar="FILE",
                        help="a Python file defining DistributedOp subclasses that register more ops (repeatable; "
                             "imported after the checkout, its code RUNS)")
    parser.add_argument("--platform", action="store_true",
                        help="import the checkout's package with its own platform layer (MindSpore or torch) instead of "
                             "layout-prop's stand-in")
    parser.add_argument("--mesh", action="append", type=mesh_arg, metavar="AxB",
                        help="a mesh shape such as 4 or 2x2 (repeatable; default 4 and 2x2)")
    parser.add_argument("--samples", type=positive_int, default=256, metavar="N",
                        help="input combinations per case and mesh, a seeded sample beyond N (default 256)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the sampling and the data (default 0)")
    parser.add_argument("--time-limit", type=time_limit_arg, default=10.0, metavar="SECONDS",
                        help="wall time one call of the checkout's code may take in the audit's worker (default 10)")
    parser_out = parser.add_mutually_exclusive_group()
    parser_out.add_argument("--json", action="store_true", help="print one JSON object")
    parser_out.add_argument("--markdown", action="store_true", help="print the per-op table as docs/audit.md shows it")
    return parser


def run(args) -> int:
    from layout_prop.interop.audit import DEFAULT_MESHES, Limits, run_audit
    from layout_prop.interop.hyper_parallel import read_checkout
    from layout_prop.io.progress import Progress

    checkout = read_checkout(args.path, platform=args.platform, modules=args.module or ())
    meshes = args.mesh or list(DEFAULT_MESHES)
    limits = Limits(call_seconds=args.time_limit)
    quiet = args.json or args.markdown
    with Progress(0, "audit", enabled=False if quiet else None) as bar:
        def progress(name: str, done: int, total: int) -> None:
            bar.total = total
            bar.label = f"audit {name}" if name else "audit"
            bar.update(done)

        report = run_audit(checkout, ops=args.op, meshes=meshes, budget=args.samples, seed=args.seed,
                           progress=progress, limits=limits)
    if args.json:
        print_json(report.to_dict())
    elif args.markdown:
        print(markdown(report))
    else:
        _print_report(report)
    return 0 if report.ok else 1
