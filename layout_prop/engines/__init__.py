"""The engines that execute lowered per-rank programs: the in-process simulator with exact
collectives (:mod:`.simulator`, :mod:`.collectives`), MindSpore's ``msrun`` (:mod:`.msrun_engine`
on the launcher, with its concerns in :mod:`.msrun_run_folders`, :mod:`.msrun_ports`,
:mod:`.msrun_watch`, :mod:`.msrun_signals`, :mod:`.msrun_link` and :mod:`.procfs`;
:mod:`.msrun_worker` in every worker, :mod:`.msrun_guard` tying their lives),
and eager execution on simulated DTensors (:mod:`.dtensor`, :mod:`.eager`).

Engines take their kernels from :mod:`layout_prop.kernels`; they import no command.
"""
