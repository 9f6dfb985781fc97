"""How far the step-time model is from measured steps: its error on published training runs.

`benchmarks/validation.py` compiles published runs (Narayanan et al. 2021 table 1,
Korthikanti et al. 2022 table 5, MT-NLG 530B, BLOOM 176B, Llama 3 405B, torchtitan's
bf16 runs) at their shapes and layouts and divides fivedc's step by the measured one; these are its figures
(tests/test_validation.py recomputes them and fails when they drift). `fivedc search`
reports them and calls layouts whose steps are closer than the model's spread a tie:
ranking them would rest on an error the model is known to make.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelError:
    runs: int  # published runs compared
    median: float  # predicted / measured step time
    low: float
    high: float
    source: str = "benchmarks/validation.py"

    @property
    def spread(self) -> float:
        """The largest relative distance of a run's ratio from the median: steps closer than
        this cannot be ranked by the model."""
        return max(self.high / self.median, self.median / self.low) - 1

    def line(self) -> str:
        return (f"the step-time model's error: ±{self.spread:.0%} on {self.runs} published runs "
                f"(predicted/measured {self.median:.2f} median, {self.low:.2f}-{self.high:.2f}; {self.source})")


STEP_TIME = ModelError(runs=29, median=0.96, low=0.75, high=1.09)
