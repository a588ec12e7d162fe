"""Built-in ops; importing this package registers their rules.

One module per op family: :mod:`.rpe` (RotaryPositionEmbedding), :mod:`.elementwise`,
:mod:`.linalg` (einsum, matmul, linear, embedding, reductions), :mod:`.shape` (reshape,
transpose, split, concat...), :mod:`.nn` (norms, softmax, attention, activations),
:mod:`.redistribute`, :mod:`.index` (gather, scatter, where...), :mod:`.order` (topk, sort,
cumsum...), :mod:`.copying` (pad, expand, stack...), :mod:`.loss` (cross entropy and the random ops),
:mod:`.attention` (fused attention), :mod:`.moe` (expert routing) and :mod:`.ring` (ring attention's
steps); :mod:`.common` holds shared helpers.
"""

import importlib
import pkgutil



def family_modules() -> tuple[str, ...]:
    """The op family modules: every module of this package but the shared helpers (``common``), in name
    order.  Importing one registers its ops; a module added here is found, no list to extend."""
    return tuple(info.name for info in pkgutil.iter_modules(__path__) if info.name != "common")


def load_families() -> None:
    """Import every op family module (a family that needs another imports it first)."""
    for name in family_modules():
        importlib.import_module(f"{__name__}.{name}")


LOADED = False  # (the registry loads plugins only once every built-in family is imported)
load_families()
LOADED = True
