"""The performance model: cluster profiles, a cost per op, collectives priced by algorithm, and
a training step's time (``layout-prop estimate``).

:mod:`.clusters` (built-in profiles and cluster files), :mod:`.costs` (FLOPs and bytes of an op
on its local shapes), :mod:`.collectives` (a collective's time on the links its mesh axis spans)
and :mod:`.step` (forward, backward, gradient synchronisation and optimizer of one step).
"""
