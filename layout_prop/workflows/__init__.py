"""The drivers the commands call: one function per command's work, each taking parsed values (a graph,
a cluster profile, numbers) and returning data (a record, a report), printing nothing.

A command module in :mod:`layout_prop.commands` parses its flags, calls one function here (or in
:mod:`layout_prop.api`, :mod:`layout_prop.runner`), and prints what it returns; benchmarks and the Python
API call the same functions.  Nothing here imports :mod:`layout_prop.commands` or :mod:`layout_prop.cli`.

- :mod:`.model_input`: a command's input read (``load_graph``: a spec, or a model with ``--plan``).
- :mod:`.blocks`: a spec's ``zero:``, ``recompute:`` and ``pipeline:`` blocks, read and applied the same way
  by check, run, estimate and pipeline.
- :mod:`.check`: the analysis as the blocks ask (``check_graph``).
- :mod:`.run`: a run with the blocks applied (``run_spec``, ``run_pipelined``).
- :mod:`.pipeline`: a spec's pipeline built, summarised, and run on every rank (``build``, ``run_pipeline``).
- :mod:`.estimate`: a training step's modelled time (``estimate``, ``estimate_pipelined``) and the
  ``--global-batch`` check the search shares (``check_global_batch``).
- :mod:`.plan`: ``plan``'s solver run measured against a baseline (``plan_spec``).
- :mod:`.search`: ``plan --search`` (``run_search``, ``best_spec``, ``format_result``).
- :mod:`.export`: the checked plan and a target's module text (``export_text``), with a pipelined plan's
  chunks and stage (``collect_plan``, ``pipeline_chunks``, ``stage_collect``).
- :mod:`.explain`: a value's derivation as data (``explain_value``).
"""
