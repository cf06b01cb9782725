"""What the cost model predicts for one plan: step time with its breakdown, memory per device, a timeline."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """One span on the simulated timeline (Chrome trace 'X' event)."""

    name: str
    """What ran, e.g. `F mb3 stage1`, `all-reduce grads bucket 2`."""
    device: int
    """Representative device (pipeline rank) it ran on."""
    stream: str
    """`compute`, `optimizer`, or a communication stream name (`tp`, `dp`, `pp`)."""
    start_s: float
    """Start time in seconds from the step's start."""
    duration_s: float
    """Duration in seconds."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The predicted cost of one training step under one plan."""

    step_time_s: float
    """Predicted wall time of one optimizer step."""
    breakdown: Mapping[str, float]
    """Seconds per part of the critical path: compute_s, exposed_comm_s, bubble_s, optimizer_s (they add up to
    step_time_s), plus informative totals (e.g. tp_comm_s, dp_comm_s, pp_comm_s, recompute_s)."""
    peak_memory_bytes: int
    """Largest per-device peak over all devices."""
    memory_per_device_bytes: tuple[int, ...]
    """Peak bytes per pipeline rank (devices in one rank are symmetric)."""
    memory_breakdown: Mapping[str, int]
    """Bytes on the most loaded device: parameters, gradients, optimizer, activations, buffers, headroom."""
    tflops_per_device: float
    """Model FLOPs (no recompute) per second per device, in TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation: tflops_per_device / device peak at the plan's precision."""
    fits: bool
    """Whether peak_memory_bytes fits the device's usable memory."""
    assumptions: tuple[str, ...] = ()
    """Human-readable assumptions behind the numbers (printed with every prediction)."""
    timeline: tuple[TraceEvent, ...] = field(default=(), repr=False)
    """Simulated spans, when asked for."""

    def calibrated(self, scale: float, source: str) -> "Prediction":
        """This prediction with its step time (and every time in the breakdown) multiplied by `scale`, the
        measured/predicted ratio that `plan measure --calibrate` recorded for this profile; throughput scales by
        1/scale. Memory is unchanged. The assumption list says so."""
        return replace(
            self, step_time_s=self.step_time_s * scale,
            breakdown={k: v * scale for k, v in self.breakdown.items()},
            tflops_per_device=self.tflops_per_device / scale, mfu=self.mfu / scale,
            assumptions=self.assumptions + (f"calibrated: step times x{scale:.3g}, the median measured/predicted "
                                            f"ratio of the runs recorded in {source}",),
            timeline=tuple(replace(e, start_s=e.start_s * scale, duration_s=e.duration_s * scale)
                           for e in self.timeline))

    def to_dict(self) -> dict[str, Any]:
        """The plan.json `predicted` object (the timeline is written separately)."""
        return {
            "step_time_s": self.step_time_s,
            "breakdown": dict(self.breakdown),
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_per_device_bytes": list(self.memory_per_device_bytes),
            "memory_breakdown": dict(self.memory_breakdown),
            "tflops_per_device": self.tflops_per_device,
            "mfu": self.mfu,
            "fits": self.fits,
            "assumptions": list(self.assumptions),
        }
