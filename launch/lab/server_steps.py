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
  }
