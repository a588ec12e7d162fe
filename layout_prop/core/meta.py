"""Names of the node metadata keys through which passes talk (as torch.fx ``node.meta``).

- ``SPECS``: tuple of output :class:`~layout_prop.core.spec.TensorSpec` (or None), written by propagate.
- ``VIOLATIONS``: tuple of located :class:`~layout_prop.core.errors.Violation`, written by propagate.
- ``WANTS``: tuple, per input, of the Layout the kernel needs (or None), written by propagate.
- ``ATTRS``: the op's normalised attrs (defaults filled), written by propagate.
- ``INSERTED_BY``: on nodes a transforming pass created: the pass name (``reshard``, ``backward``).
- ``GRAD_OF``: on backward nodes producing an input's gradient: the primal input's name.
"""

SPECS = "specs"
VIOLATIONS = "violations"
WANTS = "wants"
ATTRS = "attrs"
INSERTED_BY = "inserted_by"
GRAD_OF = "grad_of"
