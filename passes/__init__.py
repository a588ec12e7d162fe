"""Passes over the graph IR, one per module (installed as ``layout_prop.passes``).

The pass protocol (:class:`~.base.GraphPass`, :class:`~.base.PassResult`,
:class:`~.base.PassContext`, :class:`~.base.PassPipeline`) is in :mod:`.base`; the one
Backward -> Reshard chain is :data:`.resolve.RESOLVE`.  Analysis passes (:mod:`.propagate`,
:mod:`.check`, :mod:`.memory`, :mod:`.kernel_check`, :mod:`.verify`) only write node metadata;
transforming passes (:mod:`.complete`, :mod:`.expand`, :mod:`.reshard`, :mod:`.backward`,
:mod:`.lower`) build a new graph (or program) and leave their input as it was.  Passes import the core and the op rules through the registry; no command, no
engine, no frontend.
"""
