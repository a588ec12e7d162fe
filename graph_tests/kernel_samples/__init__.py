"""Sample arguments of the op families' kernels: one module per family here, else the op database's.

``test_msrun.test_mindspore_kernels_match_numpy`` runs every sample through the MindSpore
and the numpy kernel and compares them.  A module here defines
``samples(rng, f32) -> {op: [(args, attrs), ...]}`` (``f32(*shape)`` draws float32 data), for
arguments the op database does not make (a rank's localised attrs); a module added here is
found (no list to extend).  Every other op of a family's MindSpore kernel module
(``kernels/<family>_mindspore.py``) is sampled from its op database records
(:func:`record_samples`), so a new family needs no module here.
"""

import importlib
import pkgutil

import numpy as np

#: the families with samples here: every module of this package, in name order
FAMILIES = tuple(info.name for info in pkgutil.iter_modules(__path__))


def family_samples(rng, f32) -> dict:
    out = {}
    for family in FAMILIES:
        out.update(importlib.import_module(f"{__name__}.{family}").samples(rng, f32))
    from layout_prop.kernels import family_tables

    family_ops = {op for table in family_tables("mindspore") for op in table}
    out.update(record_samples(rng, f32, sorted(family_ops - set(out))))
    return out


def record_samples(rng, f32, ops) -> dict:
    """Kernel arguments for ``ops`` from their op database records: an array per operand of the
    sample's shape and dtype (floats from ``f32``, integers within the rule's ``input_domain``,
    else in [0, 8)), the attrs as the rule normalises them."""
    from layout_prop import DeviceMesh, Layout, TensorSpec
    from layout_prop.core.registry import get_rule
    from layout_prop.testing.opdb import all_records

    mesh = DeviceMesh((1,), ("dp",))
    out = {}
    for record in all_records():
        if record.op not in ops:
            continue
        rule = get_rule(record.op)
        for sample in record.samples:
            dtypes = sample.dtypes or ["float32"] * len(sample.shapes)
            specs = tuple(TensorSpec(tuple(s), d, Layout.replicated(mesh, len(s))) for s, d in zip(sample.shapes,
                                                                                                     dtypes))
            attrs = rule.normalize_attrs(dict(sample.attrs))
            args = []
            for i, (spec, dtype) in enumerate(zip(specs, dtypes)):
                if dtype.startswith("float"):
                    args.append(f32(*spec.shape).astype(dtype))
                elif dtype == "bool":
                    args.append(rng.integers(0, 2, spec.shape).astype(bool))
                else:
                    domain = rule.input_domain(i, specs, attrs)
                    low, high = (int(domain.low), int(domain.high)) if domain is not None else (0, 8)
                    args.append(rng.integers(low, high, spec.shape).astype(np.dtype(dtype)))
            out.setdefault(record.op, []).append((tuple(args), attrs))
    return out
