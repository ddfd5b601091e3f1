"""Latency targets: MLPerf Inference v5.0's LLM presets and ``TTFT_S:TPOT_S`` pairs.

Contract: ``parse_slo(text, scale)`` takes a preset name (``interactive`` 450 ms / 40 ms: Llama
2 70B interactive; ``server`` 2 s / 200 ms: Llama 2 70B server; ``long`` 6 s / 175 ms: Llama 3.1
405B server) or ``TTFT_S:TPOT_S`` and multiplies both targets by ``scale`` (slow machines);
raises ``ValueError`` on anything else. ``Slo.met(ttft_s, tpot_s)``: both at or under target (a
one-token answer has no TPOT and meets it).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Slo:
  name: str
  ttft_s: float
  tpot_s: float

  def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
    if ttft_s is None or ttft_s > self.ttft_s:
      return False
    return tpot_s is None or tpot_s <= self.tpot_s


PRESETS = {"interactive": Slo("interactive", 0.45, 0.04), "server": Slo("server", 2.0, 0.2),
           "long": Slo("long", 6.0, 0.175)}


def parse_slo(text: str, scale: float = 1.0) -> Slo:
  if scale <= 0:
    raise ValueError(f"slo_scale must be > 0, got {scale}")
  if text in PRESETS:
    base = PRESETS[text]
  else:
    try:
      ttft, tpot = (float(x) for x in text.split(":"))
    except ValueError:
      raise ValueError(f"slo: {text!r} is neither a preset ({', '.join(PRESETS)}) nor "
                       "TTFT_S:TPOT_S") from None
    if not (ttft > 0 and tpot > 0):
      raise ValueError(f"slo: targets must be > 0, got {text!r}")
    base = Slo("custom", ttft, tpot)
  return Slo(base.name, base.ttft_s * scale, base.tpot_s * scale)
