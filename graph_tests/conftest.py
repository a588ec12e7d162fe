"""Session-wide guards for the test suite."""

from __future__ import annotations

import sys

import pytest


def _mindspore_mode():
    """MindSpore's execution mode, or None when no test has imported MindSpore yet."""
    mindspore = sys.modules.get("mindspore")
    return None if mindspore is None else mindspore.get_context("mode")


@pytest.fixture(scope="module", autouse=True)
def _mindspore_mode_is_restored(request):
    """A module that changes MindSpore's global mode must set it back.

    A leaked GRAPH_MODE made later modules' ``mindspore.grad`` compile the RPE kernels'
    shape checks (which raise ``OpError``, a type MindSpore's graph parser refuses): the
    failure showed up far from its cause, and only in the whole suite.
    """
    before = _mindspore_mode()
    yield
    after = _mindspore_mode()
    if before is None:
        before = 1  # MindSpore's default, PYNATIVE_MODE
    if after is not None and after != before:
        mindspore = sys.modules["mindspore"]
        mindspore.set_context(mode=before)
        pytest.fail(f"{request.module.__name__} left MindSpore's mode at {after} (was {before}); "
                    "set it inside a context manager that restores it", pytrace=False)
