"""The drivers the commands call: one function per command's work, each taking parsed values (a graph,
a cluster profile, numbers) and returning data (a record, a report), printing nothing.

A command module in :mod:`layout_prop.commands` parses its flags, calls one function here (or in
:mod:`layout_prop.api`, :mod:`layout_prop.runner`), and prints what it returns; benchmarks and the Python
API call the same functions.  Nothing here imports :mod:`layout_prop.commands` or :mod:`layout_prop.cli`.

- :mod:`.blocks`: a spec's ``zero:``, ``recompute:`` and ``pipeline:`` blocks, read and applied the same way
  by check, run, estimate and pipeline.
- :mod:`.pipeline`: a spec's pipeline built, summarised, and run on every rank (``build``, ``run_pipeline``).
- :mod:`.estimate`: a training step's modelled time (``estimate``, ``estimate_pipelined``) and the
  ``--global-batch`` check the search shares (``check_global_batch``).
"""
