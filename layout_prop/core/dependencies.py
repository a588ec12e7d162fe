"""Optional dependencies, said before a command starts its work.

layout-prop installs with numpy, networkx and PyYAML only.  What else a command needs comes
with an extra of the package (setup.cfg's ``extras_require``), and each command calls
:func:`require` for it before it reads or computes anything: ``plan`` without scipy used to
work for 30 s, then end with ``internal-error: ModuleNotFoundError``.

=============  ==============  ===================================================
module         extra           needed by
=============  ==============  ===================================================
scipy          ``plan``        ``plan`` (the solver: HiGHS through scipy's milp)
onnx           ``onnx``        a model ``.onnx`` given to import, check, run, plan...
mindspore      ``mindspore``   a model ``.mindir`` (its protobuf schema), ``run --engine mindspore``
matplotlib     ``viz``         ``viz -o FILE.png`` (said as ``png-unavailable`` by viz/png.py)
=============  ==============  ===================================================

The check finds the module without importing it (importing MindSpore takes seconds), except
for the modules of :data:`IMPORTED`, cheap to import, which are imported: a scipy that is
installed but broken (its import raises ``ImportError``, not ``ModuleNotFoundError``: a
missing shared library, a half-removed install) is then the same one-line refusal, naming
the error, rather than an internal error where the solver imports it.

Examples
--------
>>> require("json", "this example")
>>> require("no_such_module_xyz", "plan", "plan")
Traceback (most recent call last):
...
layout_prop.core.dependencies.MissingDependency: missing-dependency: plan needs no_such_module_xyz, which is \
not installed (hint: pip install 'layout-prop[plan]')
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from .errors import LayoutPropError, cut

__all__ = ["EXTRAS", "MissingDependency", "available", "require", "require_model_reader"]

#: each optional module and the extra of layout-prop that installs it
EXTRAS = {"scipy": "plan", "onnx": "onnx", "mindspore": "mindspore", "matplotlib": "viz"}

#: the modules :func:`require` imports (a fraction of a second) rather than only finds: what the
#: command imports later, so that a broken install is said before the work
IMPORTED = {"scipy": ("scipy", "scipy.optimize")}

#: a model file's suffix -> (the module that reads it, what for)
MODEL_READERS = {".onnx": ("onnx", "reading an ONNX model"), ".mindir": ("mindspore", "reading a MindIR model")}


class MissingDependency(LayoutPropError):
    """An optional package a command needs is not installed (``missing-dependency``, exit 2)."""


def available(module: str) -> bool:
    """Whether ``module`` can be found (without importing it; a module hidden with
    ``sys.modules[name] = None`` or refused by an import hook counts as missing).

    >>> available("json"), available("no_such_module_xyz")
    (True, False)
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError):  # a hook that refuses it, a module without a __spec__
        return False


def require(module: str, feature: str, extra: str | None = None) -> None:
    """Raise :class:`MissingDependency` naming ``feature`` and the extra that installs ``module``
    unless ``module`` is installed.

    Parameters
    ----------
    module : str
        The top-level module (``scipy``).
    feature : str
        What needs it, as the user asked for it (``plan``, ``viz -o FILE.png``).
    extra : str, optional
        The extra of layout-prop that installs it (default: :data:`EXTRAS`'s).
    """
    extra = extra or EXTRAS.get(module)
    hint = f"pip install 'layout-prop[{extra}]'" if extra else f"pip install {module}"
    if not available(module):
        raise MissingDependency("missing-dependency", f"{feature} needs {module}, which is not installed", hint=hint)
    for name in IMPORTED.get(module, ()):
        try:
            importlib.import_module(name)
        except ImportError as exc:  # installed, and broken: ModuleNotFoundError of a piece, or ImportError
            raise MissingDependency("missing-dependency", f"{feature} needs {module}, which is installed but cannot "
                                    f"be imported ({type(exc).__name__}: {cut(str(exc), 120)[1:-1]})",
                                    hint=f"reinstall it: pip install --force-reinstall "
                                    f"{repr(f'layout-prop[{extra}]') if extra else module}") from None


def require_model_reader(path: str | Path) -> None:
    """:func:`require` the module that reads the model file ``path`` (by its suffix); nothing for
    another suffix (a spec, or a name the importer refuses with its own message)."""
    reader = MODEL_READERS.get(Path(str(path)).suffix.lower())
    if reader is not None:
        require(*reader)
