"""``layout-prop verify OP``: check an op's transfer function on every placement combination."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layout_prop.core.errors import LayoutPropError, cut, describe

from .printing import print_json
from .flags import MAX_JOBS, RUNS_CODE, jobs_arg, mesh_arg, non_negative_int, samples_arg

__all__ = ["add_parser", "run", "import_module_file"]


def import_module_file(path: Path) -> None:
    """Import a user's Python file (it registers ops and kernels as it is imported)."""
    import importlib.util

    from layout_prop.core.errors import OpError

    if not path.is_file():
        raise OpError("module-not-found", f"no Python file at {str(path)!r}", hint="give the path of a .py file")
    spec = importlib.util.spec_from_file_location(f"layout_prop_user_{path.stem}", path)
    if spec is None or spec.loader is None:  # (Python imports files whose name ends in .py)
        raise OpError("module-failed", f"cannot import {cut(str(path))}: not a Python file name",
                      hint="give the path of a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except LayoutPropError:
        raise
    except BaseException as exc:  # SystemExit(7) or KeyboardInterrupt from the user's file too: exit 2, one line
        raise OpError("module-failed", f"importing {cut(str(path))} failed: {describe(exc)}",
                      hint="run the file with python to see the full error") from None


#: above this many combinations, verify says how to sample or parallelise before it starts
VERIFY_ADVICE_THRESHOLD = 5_000


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``layout-prop verify``'s flags, on the command line's ``subparsers``."""
    parser = subparsers.add_parser("verify", help="check an op's transfer function on every placement combination",
                            epilog=RUNS_CODE)
    parser.add_argument("op", metavar="OP", help="a built-in op or one registered by --module")
    parser.add_argument("--module", type=Path,
                        help="a Python file that registers the op (rule and numpy kernel); it is imported, so its "
                             "code RUNS with your permissions: give only a file you trust")
    parser.add_argument("--mesh", action="append", type=mesh_arg, metavar="AxB",
                        help="a mesh shape such as 2x2 (repeatable; default 2 and 2x2)")
    parser.add_argument("--backward", action="store_true", help="also compare gradients")
    parser.add_argument("--samples", type=samples_arg, default="all",
                        help="placement combinations per sample and mesh: 'all' (default) or a number (seeded)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the sampling and the data (default 0)")
    parser.add_argument("--jobs", type=jobs_arg, default=1,
                        help=f"processes to check combinations in (default 1, at most {MAX_JOBS}; the counts are the same)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def run(args) -> int:
    from layout_prop.io.progress import Progress
    from layout_prop.testing import combination_specs, verify_op

    if args.module:
        import_module_file(args.module)
    meshes = args.mesh or [(2,), (2, 2)]
    total = len(combination_specs(args.op, meshes=meshes, placements=args.samples, seed=args.seed))
    if total > VERIFY_ADVICE_THRESHOLD and not args.json:
        print(f"layout-prop: verify {args.op}: {total:,} combinations to try; --samples N checks a seeded sample "
              f"of N per sample shape and mesh, --jobs N uses N processes", file=sys.stderr)
    with Progress(total, f"verify {args.op}", enabled=False if args.json else None) as bar:
        report = verify_op(args.op, meshes=meshes, placements=args.samples, backward=args.backward, seed=args.seed,
                           jobs=args.jobs, progress=lambda done, _total: bar.update(done))
    data = report.to_dict()
    if args.json:
        print_json(data)
    else:
        print(f"op {report.op}: {report.combinations} combinations on meshes "
              + ", ".join("x".join(map(str, m)) for m in meshes))
        checked = "" if report.mismatches else " and numerically right"
        print(f"  accepted{checked}: {report.accepted}")
        by_code = ", ".join(f"{code} {n}" for code, n in sorted(report.fixed.items()))
        print(f"  rejected, then fixed by --reshard{checked}: {report.resharded}" + (f" ({by_code})" if by_code else ""))
        by_code = ", ".join(f"{code} {n}" for code, n in sorted(report.refused_codes.items()))
        print(f"  rejected, no redistribution fixes them: {report.refused}" + (f" ({by_code})" if by_code else ""))
        if report.unusable:
            print(f"  layouts that cannot exist (skipped): {report.unusable}")
        for code in data["undocumented"]:
            print(f"  UNDOCUMENTED violation code: {code}")
        for spec in data["unfixed"]:
            print(f"  FIXABLE BUT NOT FIXED by --reshard: {json.dumps(spec)}")
        for m in report.mismatches:
            print(f"  MISMATCH {m.message}")
            print(f"    minimal failing spec: {json.dumps(m.spec)}")
        print("all combinations are right or rejected with a documented code" if report.ok else "FAILED")
    return 0 if report.ok else 1
