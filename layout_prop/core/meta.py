"""Names of the node metadata keys through which passes talk (as torch.fx ``node.meta``).

- ``SPECS``: tuple of output :class:`~layout_prop.core.spec.TensorSpec` (or None), written by propagate.
- ``VIOLATIONS``: tuple of located :class:`~layout_prop.core.errors.Violation`, written by propagate.
- ``WANTS``: tuple, per input, of the Layout the kernel needs (or None), written by propagate.
- ``ATTRS``: the op's normalised attrs (defaults filled), written by propagate.
- ``INSERTED_BY``: on nodes a transforming pass created: the pass name (``reshard``, ``backward``).
- ``GRAD_OF``: on backward nodes producing an input's gradient: the primal input's name.
- ``FOR``: on a ``redistribute`` node a pass inserted: ``(consumer, value)``, the node whose input
  it moves and the value it moves (reshard, the solver's realise; backward's ``grad/NAME``, which
  names itself); recompute and the step model charge the move to that consumer.

And the keys of ``graph.meta``, the graph-level metadata:

- ``LINKS``: the mesh's per-axis links (``mesh: links:``, :func:`layout_prop.core.links.parse_links`),
  written by the spec loader.
- ``PIPELINE``, ``TRAINING``, ``ZERO``, ``RECOMPUTE``: the spec's blocks of those names, as written
  (the loader); the ZeRO pass replaces ``ZERO`` by its parsed config, and writes ``ZERO_WHOLE``,
  the names of the parameters whose layout cannot take the ZeRO axes (stored whole).
- ``IMPORT_NOTES``: what an importer noted (opaque ops...), and ``IMPORT_SOURCES``: the model's own
  name of each weight and constant input, written by ``layout_prop.frontends``; ``IMPORT_ALIASES``:
  the other names of de-duplicated parameters, written by ``export`` for the exporters.
"""

SPECS = "specs"
VIOLATIONS = "violations"
WANTS = "wants"
ATTRS = "attrs"
INSERTED_BY = "inserted_by"
GRAD_OF = "grad_of"
FOR = "for"

LINKS = "links"
PIPELINE = "pipeline"
TRAINING = "training"
ZERO = "zero"
ZERO_WHOLE = "zero_whole"
RECOMPUTE = "recompute"
IMPORT_NOTES = "import_notes"
IMPORT_SOURCES = "import_sources"
IMPORT_ALIASES = "import_aliases"
