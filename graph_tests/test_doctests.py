"""Every docstring example in the installed package runs and prints what it shows.

Modules are imported under their installed names (``layout_prop.ops.rpe``), so the op
registry sees each rule once.
"""

import doctest
import importlib
import pkgutil

import pytest



PACKAGES = ("layout_prop", "layout_prop.testing", "layout_prop.frontends", "layout_prop.viz",
            "layout_prop.ops", "layout_prop.passes", "layout_prop.kernels")


def _modules():
    # the sub-packages live in other folders (setuptools package_dir), so walk each one
    names = set()
    for pkg_name in PACKAGES:
        pkg = importlib.import_module(pkg_name)
        names.add(pkg_name)
        for info in pkgutil.iter_modules(pkg.__path__, pkg_name + "."):
            names.add(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
