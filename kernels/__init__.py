"""Kernel tables, one per backend (installed as ``layout_prop.kernels``): the numpy reference
(:mod:`.numpy_backend`, with the op families' kernels in ``*_numpy``), MindSpore
(:mod:`.mindspore_backend`) and the CANN RotaryPositionEmbedding kernel (:mod:`.rpe_cann`).

Kernels compute one rank's local piece; the engines that run them live in
:mod:`layout_prop.engines`.
"""

import importlib
import pkgutil


def family_tables(backend: str) -> list[dict]:
    """The kernel tables (``KERNELS``) of every family module of ``backend``: the modules of this
    package named ``*_BACKEND`` (``index_numpy``, ``index_mindspore``...), in name order; a module
    without a table (helpers such as ``rpe_numpy``) is skipped.  A family's kernel module is found
    by its name: no registration list to extend.

    >>> any("gather" in table for table in family_tables("numpy"))  # index_numpy's table
    True
    """
    names = sorted(info.name for info in pkgutil.iter_modules(__path__) if info.name.endswith(f"_{backend}"))
    modules = [importlib.import_module(f"{__name__}.{name}") for name in names]
    return [module.KERNELS for module in modules if hasattr(module, "KERNELS")]
