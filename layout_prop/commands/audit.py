"""``layout-prop audit PATH``: judge a hyper-parallel checkout's sharding rules by execution."""

from __future__ import annotations

import sys

from .printing import print_json

__all__ = ["run"]


def _print_finding(kind: str, finding) -> None:
    print(f"  {kind.replace('_', '-')} reproducer (mesh {'x'.join(map(str, finding.mesh.shape))}, "
          f"{finding.case.describe()}):")
    for line in finding.upstream_code().splitlines():
        print(f"      {line}")
    print(f"    hyper-parallel: {finding.upstream_answer}")
    print(f"    layout-prop:    {finding.ours}")
    if finding.message:
        print(f"    {finding.message}")


def _print_report(report) -> None:
    meshes = ", ".join("x".join(map(str, m)) for m in report.meshes)
    print(f"audit of {report.root} on meshes {meshes} (platform layer: {report.platform})")
    for audit in report.ops:
        c = audit.counts
        by = audit.op if "interop/judges.py" in audit.op else f"layout-prop {audit.op}"
        print(f"{audit.name} ({by}): {audit.combinations} combinations: accepted "
              f"{audit.accepted} (right {c['right']}, wrong {c['wrong']} ({audit.silent} silently), unjudged "
              f"{c['unjudged']}), rejected "
              f"{c['rejected'] + c['over_strict']} (over-strict {c['over_strict']})")
        for reason, n in sorted(audit.unjudged_reasons.items()):
            print(f"  unjudged {n}: {reason}")
        for kind in ("wrong", "over_strict"):
            if kind in audit.examples:
                _print_finding(kind, audit.examples[kind])
    if report.not_mapped:
        print(f"not mapped ({len(report.not_mapped)}):")
        for name, reason in sorted(report.not_mapped.items()):
            print(f"  {name}: {reason}")
    for name, reason in sorted(report.failed.items()):
        print(f"failed to load {name}: {reason}")
    t = report.totals()
    print(f"total: {t['combinations']} combinations, right {t['right']}, wrong {t['wrong']} "
          f"({t['wrong_silently']} silently), over-strict "
          f"{t['over_strict']}, rejected {t['rejected']}, unjudged {t['unjudged']}")
    if not t["combinations"]:  # every op named is not mapped (or failed to load): "all right" would be vacuous
        print("no combination audited: nothing was judged")
    else:
        print("every accepted answer is right" if report.ok else "WRONG answers found")


def run(args) -> int:
    from layout_prop.interop.audit import DEFAULT_MESHES, run_audit
    from layout_prop.interop.hyper_parallel import add_registered, load_checkout

    from .verify import import_module_file

    checkout = load_checkout(args.path, platform=args.platform)
    for module in args.module or ():
        import_module_file(module)
        add_registered(checkout, str(module))
    meshes = args.mesh or list(DEFAULT_MESHES)
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(name: str) -> None:
            print(f"layout-prop: audit {name}", file=sys.stderr)
    report = run_audit(checkout, ops=args.op, meshes=meshes, budget=args.samples, seed=args.seed, progress=progress)
    if args.json:
        print_json(report.to_dict())
    else:
        _print_report(report)
    return 0 if report.ok else 1
