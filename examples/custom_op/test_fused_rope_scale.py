"""Verify the user op with the testing kit: every placement combination on 1-D and 2-D meshes.

Run: ``python -m pytest examples/custom_op``.
"""

import importlib.util
import sys
from pathlib import Path

from layout_prop.testing import assert_op_correct

_path = Path(__file__).with_name("fused_rope_scale.py")
if "fused_rope_scale" not in sys.modules:  # import the op module once (it registers the op)
    _spec = importlib.util.spec_from_file_location("fused_rope_scale", _path)
    sys.modules["fused_rope_scale"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["fused_rope_scale"])


def test_fused_rope_scale_is_right_on_every_layout():
    report = assert_op_correct("fused_rope_scale", meshes=[(2,), (2, 2)], placements=150, backward=True)
    assert report.accepted + report.resharded > 100
