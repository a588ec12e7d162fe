"""The in-process SPMD simulator: every rank's local program, collectives exact.

Ranks advance in lockstep through the program (SPMD: the same ops everywhere): a
``kernel`` op runs the backend's kernel on each rank's local arrays with that rank's
localised attrs; a ``slice`` or ``collective`` op runs the planned step on every group
of its mesh axis at once (:func:`layout_prop.kernels.collectives.apply_step`), uneven
shards included.

Examples
--------
>>> import numpy as np
>>> from layout_prop.loader import load_spec
>>> from layout_prop.api import analyze
>>> from layout_prop.passes.lower import Lower
>>> g = analyze(load_spec('''
... mesh: {shape: [2], names: [tp]}
... inputs: {a: {shape: [3], placements: ["P(sum)"]}, b: {shape: [3]}}
... nodes: [{name: c, op: add, inputs: [a, b]}]
... '''), reshard=True).graph
>>> prog = Lower().run(g).program
>>> out = Simulator().execute(prog, {"a": np.arange(3.0), "b": np.ones(3)}, np.random.default_rng(0))
>>> [np.allclose(local, [1.0, 2.0, 3.0]) for local in out["c"]]
[True, True]
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from layout_prop.errors import ExecutionError

from .collectives import apply_step, scatter_global
from .numpy_backend import KERNELS, get_kernel

__all__ = ["Simulator"]


class Simulator:
    """Runs a lowered :class:`~layout_prop.passes.lower.Program` on all ranks in one process."""

    name = "sim"

    def __init__(self, kernels: dict[str, Callable] | None = None, backend: str = "numpy") -> None:
        self.kernels = KERNELS if kernels is None else kernels
        self.backend = backend

    def execute(self, program, global_inputs: dict[str, np.ndarray],
                rng: np.random.Generator | None = None,
                scattered: dict[str, list[np.ndarray]] | None = None) -> dict[str, list[np.ndarray]]:
        """Every local value of every rank: ``{value: [array of rank 0, array of rank 1, ...]}``.

        ``scattered`` may give inputs already cut into per-rank pieces (then ``rng`` is not used
        for them); the others are cut from ``global_inputs`` with ``scatter_global``.
        """
        ranks = program.mesh.size
        env: dict[str, list[np.ndarray]] = {}
        for op in program.ops:
            if op.kind == "input":
                if scattered is not None and op.name in scattered:
                    env[op.name] = scattered[op.name]
                    continue
                if op.name not in global_inputs:
                    raise ExecutionError("missing-input", f"no value given for graph input {op.name!r}",
                                         input=op.name, hint="give every graph input an array")
                env[op.name] = scatter_global(np.asarray(global_inputs[op.name]), op.specs[0], rng)
            elif op.kind == "kernel":
                fn = get_kernel(op.op, self.kernels, self.backend)
                results = []
                for r in range(ranks):
                    args = [env[v][r] for v in op.inputs]
                    try:
                        results.append(fn(*args, **op.attrs[r]))
                    except ExecutionError:
                        raise
                    except Exception as exc:  # a kernel failing on a rank's local shapes is reported, not hidden
                        shapes = [list(a.shape) for a in args]
                        raise ExecutionError("kernel-failed", f"kernel {op.op!r} failed on rank {r} with local "
                                             f"shapes {shapes}: {type(exc).__name__}: {exc}", node=op.source,
                                             hint="the op's localize rule or its layout rule is wrong") from exc
                if len(op.outputs) == 1:
                    env[op.outputs[0]] = [np.asarray(res) for res in results]
                else:
                    for k, value in enumerate(op.outputs):
                        env[value] = [np.asarray(res[k]) for res in results]
            else:
                env[op.outputs[0]] = apply_step(op.step, env[op.inputs[0]])
        return env
