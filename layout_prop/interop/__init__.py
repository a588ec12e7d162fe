"""Working with other projects' sharding rules: ``audit`` judges hyper-parallel's ``infer_layout`` numerically;
``export`` writes a checked plan for hyper-parallel, MindSpore or torch (export_plan.py and one module per target).

May import: core, io, ops, kernels, passes, engines, testing (graph_tests/test_layering.py).
"""

from .audit import AuditReport, OpAudit, run_audit
from .hyper_parallel import Checkout, from_upstream, load_checkout, to_upstream, upstream_text

__all__ = ["AuditReport", "OpAudit", "run_audit", "Checkout", "load_checkout", "to_upstream", "from_upstream",
           "upstream_text"]
