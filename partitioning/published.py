"""Published step times of the paper's own runs (Pope et al., MLSys 2023), with where each number
comes from: the calibration data for TPU v4 (``partitioning.calibration``).

Contract: ``PALM_540B_TPU_V4`` is a tuple of ``Published`` runs (PaLM 540B, 64 TPU v4 chips,
context 2048). ``measured_s`` is one step: decode, one generated token; prefill, the prompt pass.
Only the two figures of the paper's abstract could be checked against the paper's own text here
(arXiv 2211.05102 v1, abstract; MLSys 2023 proceedings page): 29 ms per generated token at low
batch with int8 weights, and 76% MFU on large-batch prefill. The batch sizes and layouts beside
them (decode batch 64 on 2D weight-stationary with batch-sharded attention; prefill batch 512 on
weight-gathered XYZ) are from a third-party summary of the paper's Table 2 and are marked
``unverified``; the paper's tables themselves (and its PaLM 62B configurations, which would be
the held-out validation) were not reachable from this machine.
"""

from __future__ import annotations

import dataclasses

from models.config import get_preset
from partitioning import cost_model


@dataclasses.dataclass(frozen=True)
class Published:
  model: str
  hardware: str
  mesh: tuple[int, int, int]
  phase: str
  batch: int
  context: int
  weights: str
  layout: str
  attention: str
  measured_s: float
  figure: str  # the published figure as stated
  source: str
  unverified: str = ""  # which parts come from a secondary source


def _prefill_s_at_mfu(mfu: float, batch: int, context: int, chips: int) -> float:
  flops = cost_model.step_flops(get_preset("palm-540b"), "prefill", batch, context)
  return flops / (mfu * chips * 275e12)  # TPU v4 bf16 peak (partitioning.hardware)


PALM_540B_TPU_V4 = (
    Published("palm-540b", "tpu-v4", (4, 4, 4), "decode", 64, 2048, "int8", "ws_2d", "batch_yz",
              0.029, "29 ms per token, low batch, int8 weights",
              "arXiv 2211.05102 v1, abstract",
              "batch 64 and the layout (2D weight-stationary, batch-sharded attention): "
              "third-party summary of Table 2"),
    Published("palm-540b", "tpu-v4", (4, 4, 4), "prefill", 512, 2048, "bf16", "wg_xyz",
              "batch_xyz", _prefill_s_at_mfu(0.76, 512, 2048, 64),
              "76% MFU, large-batch prefill (the step time at that MFU)",
              "arXiv 2211.05102 v1, abstract",
              "batch 512, bf16 and the layout (weight-gathered XYZ): third-party summary of "
              "Table 2"),
)

__all__ = ["Published", "PALM_540B_TPU_V4"]
