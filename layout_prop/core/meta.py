"""Names of the node metadata keys through which passes talk (as torch.fx ``node.meta``).

- ``SPECS``: tuple of output :class:`~layout_prop.core.spec.TensorSpec` (or None), written by propagate.
- ``VIOLATIONS``: tuple of located :class:`~layout_prop.core.errors.Violation`, written by propagate.
- ``WANTS``: tuple, per input, of the Layout the kernel needs (or None), written by propagate.
- ``ATTRS``: the op's normalised attrs (defaults filled), written by propagate.
- ``INSERTED_BY``: on nodes a transforming pass created: the pass name (``reshard``, ``backward``).
- ``GRAD_OF``: on backward nodes producing an input's gradient: the primal input's name.

And the keys of ``graph.meta``, the graph-level metadata:

- ``LINKS``: the mesh's per-axis links (``mesh: links:``, :func:`layout_prop.core.links.parse_links`),
  written by the spec loader.
- ``PIPELINE``, ``TRAINING``, ``ZERO``, ``RECOMPUTE``: the spec's blocks of those names, as written
  (the loader); the ZeRO pass replaces ``ZERO`` by its parsed config.
- ``IMPORT_NOTES``: what an importer noted (opaque ops...), and ``IMPORT_SOURCES``: the model's own
  name of each weight and constant input, written by ``layout_prop.frontends``.
"""

SPECS = "specs"
VIOLATIONS = "violations"
WANTS = "wants"
ATTRS = "attrs"
INSERTED_BY = "inserted_by"
GRAD_OF = "grad_of"

LINKS = "links"
PIPELINE = "pipeline"
TRAINING = "training"
ZERO = "zero"
RECOMPUTE = "recompute"
IMPORT_NOTES = "import_notes"
IMPORT_SOURCES = "import_sources"
