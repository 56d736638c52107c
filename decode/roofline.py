"""A roofline model of accelerators from their published specs (a model, not a measurement).

time = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), per device. It ignores
collectives (all-reduces over the model axis), kernel launch and host
overheads, and assumes each op reaches peak on whichever resource bounds it:
a lower bound on time, so an upper bound on speed.
"""

from __future__ import annotations

import dataclasses

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    bf16_flops: float  # peak dense bf16 FLOP/s per chip
    hbm_bytes_per_s: float  # HBM bandwidth per chip
    memory_bytes: int  # HBM per chip
    source: str


# Published per-chip figures (dense bf16, no sparsity).
PARTS: dict[str, Part] = {p.name: p for p in (
    Part("tpu-v5e", 197e12, 819e9, 16 * GiB, "cloud.google.com/tpu/docs/v5e"),
    Part("tpu-v5p", 459e12, 2765e9, 95 * GiB, "cloud.google.com/tpu/docs/v5p"),
    Part("tpu-v6e", 918e12, 1640e9, 32 * GiB, "cloud.google.com/tpu/docs/v6e"),
    Part("h100-sxm", 989e12, 3.35e12, 80 * GiB, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    Part("h200-sxm", 989e12, 4.8e12, 141 * GiB, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
)}

MODEL_NOTE = ("ROOFLINE MODEL, NOT A MEASUREMENT: time = max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth) per "
              "device, from XLA's FLOP count, a traffic model of the bytes (see cost model) and published peak "
              "figures; collectives, launch and host overheads are ignored (a lower bound on time)")


def seconds(part: Part, flops: float, bytes_accessed: float) -> float:
    """Roofline time of one program on one chip."""
    return max(flops / part.bf16_flops, bytes_accessed / part.hbm_bytes_per_s)


def predict(stage_costs: dict[str, dict], ar_cost: dict, tau: float, per_device_bytes: int | None = None,
            parts=None) -> dict:
    """Per part: ar_ms_per_token, round_ms (the stages run one after another), speedup = tau x AR / round.

    stage_costs: {stage: {"flops", "bytes"}} of one round; ar_cost: {"flops", "bytes"} of one AR step
    (every sequence of the batch advances by one token per step, by tau per round).
    """
    out = {}
    for name in parts or PARTS:
        part = PARTS[name]
        round_s = sum(seconds(part, c["flops"], c["bytes"]) for c in stage_costs.values())
        ar_s = seconds(part, ar_cost["flops"], ar_cost["bytes"])
        row = {"ar_ms_per_token": ar_s * 1e3, "round_ms": round_s * 1e3,
               "speedup": tau * ar_s / round_s if round_s > 0 else float("nan"),
               "stage_ms": {k: seconds(part, c["flops"], c["bytes"]) * 1e3 for k, c in stage_costs.items()}}
        if per_device_bytes is not None:
            row["fits"] = per_device_bytes <= part.memory_bytes
        out[name] = row
    return out
