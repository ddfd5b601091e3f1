"""The server's own step timeline over a window of a load run, read from its ``/metrics``.

Contract: ``scrape(url) -> dict`` reads a Prometheus text endpoint into {series: value} (labels
kept in the key, ``_created`` timestamps dropped; ``{}`` if it cannot be read). ``breakdown(
before, after, seconds)`` turns two scrapes of a phaseserve server (``serving.step_timeline``'s
counters) into the window's figures, all per busy step unless said:
  * ``phases_ms``: per phase (``serving.step_timeline.PHASES``) the mean wall and the loop
    thread's mean CPU ms, and the phase's share of the loop's busy time;
  * ``steps``, ``steps_per_s``, ``mean_decode_rows``, ``prefill_tokens_per_step``;
  * ``decode_only_step_ms``: the mean decode-only step (the engine's decode step at the batch
    running, what TPOT would be with no prefill beside it and no overhead around it);
  * ``programs_after_ready``: programs compiled in the window (0 with a closed program set);
  * ``host_off_cpu_ms``: wall minus CPU over the host phases (admit, plan, update, deliver,
    between): time the loop thread waited for the GIL or was descheduled;
  * ``server_ms``: the loop's own view of the window's finished requests (each sampled id
    counted when it reached the host, before detokenization and delivery): mean TTFT, TPOT and
    e2e ms (``phaseserve_{ttft,tpot,e2e}_seconds``), to set beside what the client measured;
  * ``ttft_prediction``: the early-rejection predictor against what the window's admitted
    requests got, from ``phaseserve_ttft_prediction_ratio`` (actual / predicted): requests, the
    ratio's p10 / p50 / p90 (interpolated in the histogram's buckets, as Prometheus'
    ``histogram_quantile`` does) and the share of ratios within 0.8-1.25;
or ``None`` if the endpoint had no step counters (a peer server).
"""

from __future__ import annotations

import re
import urllib.request

from serving.step_timeline import PHASES

_HOST = ("between", "admit", "plan", "update", "deliver")
_LINE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
  try:
    text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
  except (OSError, ValueError):
    return {}
  out = {}
  for line in text.splitlines():
    m = _LINE.match(line)
    if m and "_created" not in m.group(1):
      try:
        out[m.group(1)] = float(m.group(2))
      except ValueError:
        continue
  return out


def breakdown(before: dict[str, float], after: dict[str, float], seconds: float
              ) -> dict[str, object] | None:
  d = lambda key: after.get(key, 0.0) - before.get(key, 0.0)
  if "phaseserve_steps_total" not in after:
    return None
  steps = d("phaseserve_steps_total")
  if steps <= 0:
    return {"steps": 0}
  wall = {p: d(f'phaseserve_step_phase_seconds_total{{phase="{p}"}}') for p in PHASES}
  cpu = {p: d(f'phaseserve_step_phase_cpu_seconds_total{{phase="{p}"}}') for p in PHASES}
  busy = sum(wall.values())
  decode_only = d("phaseserve_decode_only_steps_total")
  return {
      "steps": int(steps), "steps_per_s": steps / seconds if seconds > 0 else None,
      "phases_ms": {p: {"wall": 1e3 * wall[p] / steps, "cpu": 1e3 * cpu[p] / steps,
                        "share": wall[p] / busy if busy else 0.0} for p in PHASES},
      "host_off_cpu_ms": 1e3 * sum(wall[p] - cpu[p] for p in _HOST) / steps,
      "mean_decode_rows": d("phaseserve_step_rows_decoded_total") / steps,
      "prefill_tokens_per_step": d("phaseserve_step_tokens_prefilled_total") / steps,
      "decode_only_step_ms": (1e3 * d("phaseserve_decode_only_step_seconds_total") / decode_only
                              if decode_only else None),
      "decode_only_steps": int(decode_only),
      "programs_after_ready": d("phaseserve_programs_after_ready"),
      "server_ms": {k: (round(1e3 * d(f"phaseserve_{k}_seconds_sum") / n, 2)
                        if (n := d(f"phaseserve_{k}_seconds_count")) > 0 else None)
                    for k in ("ttft", "tpot", "e2e")},
      "ttft_prediction": _prediction(before, after),
  }


def _buckets(before: dict[str, float], after: dict[str, float], name: str
             ) -> list[tuple[float, float]]:
  """(upper bound, cumulative count in the window), ascending; +Inf last."""
  head = f'{name}_bucket{{le="'
  out = [(float(k[len(head):-2]), v - before.get(k, 0.0)) for k, v in after.items()
         if k.startswith(head)]
  return sorted(out)


def hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
  """Prometheus' ``histogram_quantile`` over cumulative ``buckets`` (linear within a bucket; a
  rank in the +Inf bucket gives the highest finite bound)."""
  if not buckets or buckets[-1][1] <= 0:
    return None
  rank, lo, below = q * buckets[-1][1], 0.0, 0.0
  for le, cum in buckets:
    if cum >= rank:
      if le == float("inf"):
        return lo
      return lo + (le - lo) * ((rank - below) / (cum - below) if cum > below else 1.0)
    lo, below = le, cum
  return lo


def _prediction(before: dict[str, float], after: dict[str, float]) -> dict[str, object]:
  b = _buckets(before, after, "phaseserve_ttft_prediction_ratio")
  n = b[-1][1] if b else 0.0
  if n <= 0:
    return {"requests": 0}
  cum = dict(b)
  q = lambda x: None if (v := hist_quantile(b, x)) is None else round(v, 3)
  return {"requests": int(n), "ratio_p10": q(0.1), "ratio_p50": q(0.5), "ratio_p90": q(0.9),
          "within_0.8_1.25": round((cum.get(1.25, 0.0) - cum.get(0.8, 0.0)) / n, 3)}
