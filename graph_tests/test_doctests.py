"""Every docstring example in the installed package runs and prints what it shows.

Modules are imported under their installed names (``layout_prop.ops.rpe``), so the op
registry sees each rule once.
"""

import doctest
import importlib
import pkgutil

import pytest


#: The roots of the installed tree: ``ops``, ``passes`` and ``kernels`` live in folders of their own
#: (setuptools package_dir), so a walk from ``layout_prop`` alone does not reach them.
ROOTS = ("layout_prop", "layout_prop.ops", "layout_prop.passes", "layout_prop.kernels")


def _modules():
    # every module and sub-package under each root, recursively: a new room is covered without a list to keep
    names = set()
    for root in ROOTS:
        pkg = importlib.import_module(root)
        names.add(root)
        for info in pkgutil.walk_packages(pkg.__path__, root + "."):
            names.add(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
