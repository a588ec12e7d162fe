"""Kernel tables, one per backend (installed as ``layout_prop.kernels``): the numpy reference
(:mod:`.numpy_backend`, with the op families' kernels in ``*_numpy``), MindSpore
(:mod:`.mindspore_backend`) and the CANN RotaryPositionEmbedding kernel (:mod:`.rpe_cann`).

Kernels compute one rank's local piece; the engines that run them live in
:mod:`layout_prop.engines`.
"""
