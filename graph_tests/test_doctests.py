"""Every docstring example in the installed package runs and prints what it shows.

Modules are imported under their installed names (``layout_prop.ops.rpe``), so the op
registry sees each rule once.

What an example prints must not depend on the machine: no example shows a measured float32
error or a wall-clock time digit for digit (an error is compared with a bound, ``... < 1e-5``,
or elided with ``...``); CI runs these examples under two OpenBLAS kernels and two thread
counts (.ci/run). A Hypothesis property in an example (``layout_prop.testing.strategies``)
runs without Hypothesis's clock: no deadline a draw must meet and no health check of slow
input generation, which failed that example on a loaded machine (``FailedHealthCheck: Input
generation is slow: only 4 valid inputs after 8.28 seconds``).
"""

import doctest
import importlib
import pkgutil

import pytest
from hypothesis import HealthCheck, settings

#: the Hypothesis settings an example's ``@given`` runs with: what it checks, not how fast it draws
settings.register_profile("docstring-examples", deadline=None, suppress_health_check=[HealthCheck.too_slow])


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


@pytest.fixture
def unhurried_hypothesis():
    """The "docstring-examples" Hypothesis profile while one module's examples run, then the one before."""
    previous = settings.get_current_profile_name()
    settings.load_profile("docstring-examples")
    yield
    settings.load_profile(previous)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, unhurried_hypothesis):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_examples_draw_without_hypothesis_clock(unhurried_hypothesis):
    """While the examples run, a @given without settings of its own has no deadline and tolerates slow draws."""
    assert settings.default.deadline is None and HealthCheck.too_slow in settings.default.suppress_health_check


def test_the_profile_is_put_back_after_the_examples():
    assert settings.get_current_profile_name() != "docstring-examples"
