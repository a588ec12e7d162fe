"""Passes over the graph IR, one per module (installed as ``layout_prop.passes``).

Analysis passes (:mod:`.propagate`, :mod:`.check`, :mod:`.memory`, :mod:`.kernel_check`,
:mod:`.verify`) only write node metadata; transforming passes (:mod:`.complete`,
:mod:`.reshard`, :mod:`.backward`, :mod:`.lower`) build a new graph and leave their input
as it was.  Passes import the core and the op rules through the registry; no command, no
engine, no frontend.
"""
