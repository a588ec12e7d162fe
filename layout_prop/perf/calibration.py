"""The step model's error on its calibration set: published training runs it was not fitted on.

``benchmarks/published.py`` prices each published configuration of its set (Narayanan et al.
SC'21 Table 1, ten GPT rows on A100; MindFormers' four Llama figures on Ascend 910B) and prints
predicted against published throughput.  :data:`CALIBRATION` holds its summary as last measured,
so that ``estimate`` and ``plan --search`` can say how far the model is from measured runs, and
the search can call candidates closer than that a tie.  ``graph_tests/test_benchmarks.py``
checks that the figures here are the benchmark's.

>>> CALIBRATION.mae > 0 and CALIBRATION.rows >= 14
True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Calibration", "CALIBRATION"]


@dataclass(frozen=True)
class Calibration:
    """Errors of predicted against published throughput (fractions: 0.1 is 10%)."""

    rows: int
    mae: float  # mean absolute error
    max_error: float  # the largest absolute error
    signed: float  # mean signed error (positive: the model predicts faster than measured)
    measured: str  # the date of the measurement
    source: str

    def to_dict(self) -> dict:
        return {"rows": self.rows, "mean_absolute_error": self.mae, "max_error": self.max_error,
                "mean_signed_error": self.signed, "measured": self.measured, "source": self.source}

    def text(self) -> str:
        """One line for a command's output."""
        return (f"model error on {self.rows} published runs ({self.source}): mean {self.mae:.0%}, "
                f"worst {self.max_error:.0%}, bias {self.signed:+.0%} ({self.measured})")


CALIBRATION = Calibration(rows=14, mae=0.116, max_error=0.263, signed=0.106, measured="2026-12-07",
                          source="benchmarks/published.py")
