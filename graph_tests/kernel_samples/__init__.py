"""Sample arguments of the new op families' kernels, one module per family.

``test_msrun.test_mindspore_kernels_match_numpy`` runs every sample through the MindSpore
and the numpy kernel and compares them; each module defines
``samples(rng, f32) -> {op: [(args, attrs), ...]}`` (``f32(*shape)`` draws float32 data); a
module added here is found (no list to extend).
"""

import importlib
import pkgutil

#: the families with samples here: every module of this package, in name order
FAMILIES = tuple(info.name for info in pkgutil.iter_modules(__path__))


def family_samples(rng, f32) -> dict:
    out = {}
    for family in FAMILIES:
        out.update(importlib.import_module(f"{__name__}.{family}").samples(rng, f32))
    return out
