"""Memory per device: model states under ZeRO, activations in flight per pipeline schedule, buffers, headroom.

Model states (Rajbhandari et al., ZeRO, Fig. 1; formulas.csv zero_*): with mixed precision each parameter costs
2 (16-bit weight) + 2 (16-bit gradient) + K = 12 (fp32 master weight, Adam m and v) bytes, so per device
16 Psi (stage 0), 4 Psi + 12 Psi/N (stage 1), 2 Psi + 14 Psi/N (stage 2), 16 Psi/N (stage 3) for N data-parallel
ranks. In fp32 the weight and gradient take 4 bytes each and K = 8 (Adam m and v).

Activations: `in_flight` counts the micro-batches (of each chunk) whose activations one pipeline rank holds at its
peak, read off the schedule itself: GPipe holds all m, 1F1B min(p - r, m) on rank r (p on the first stage), the
interleaved schedule (p-1-r)*2 + (v-1)*p + 1 chunk-micro-batches, i.e. a (1 + (p-1)/(p v)) factor over 1F1B on the
first stage (Korthikanti et al. 2022 Sec 4.2.3; formulas.csv activation_memory_total_first_stage_1f1b).
"""
from __future__ import annotations

from collections import Counter

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default gradient bucket (bucket_cap_mb=25, torch.nn.parallel.DistributedDataParallel docs)."""


def model_state_bytes(num_params: float, zero_stage: int, dp: int, precision: str) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state for `num_params` local parameters.

    Returns {"parameters", "gradients", "optimizer"}; their sum is 16 Psi / 4 Psi + 12 Psi/N / 2 Psi + 14 Psi/N /
    16 Psi/N for ZeRO stage 0 / 1 / 2 / 3 in mixed precision."""
    if precision == "fp32":
        w, g, k = 4.0, 4.0, 8.0
    else:
        w, g, k = 2.0, 2.0, 12.0
    n = max(1, dp)
    return {
        "parameters": num_params * w / (n if zero_stage >= 3 else 1),
        "gradients": num_params * g / (n if zero_stage >= 2 else 1),
        "optimizer": num_params * k / (n if zero_stage >= 1 else 1),
    }


def in_flight(schedule: str, p: int, v: int, m: int, rank: int) -> Counter:
    """Micro-batches of each chunk whose activations `rank` holds at its peak (forwards run before its first
    backward, plus the one that backward frees)."""
    from cost_model.simulator import schedule_sequence
    if schedule == "1f1b" and v == 1:
        return Counter({0: min(p - rank, m)})
    if schedule == "gpipe":
        return Counter({0: m})
    held: Counter = Counter()
    for is_b, chunk, _ in schedule_sequence(schedule, p, v, m, rank):
        if is_b:
            break
        held[chunk] += 1
    return held
