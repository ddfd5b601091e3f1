"""Workload segments of the intervention check: each a load-generator profile with its own bar.

Contract: ``SEGMENTS[name]`` is a ``Segment``: the ``launch.lab.loadgen_lib.workload`` profile
it draws from, its length scale (a CPU serves the profiles' full lengths too slowly for a check
that runs both configs in minutes), the MLPerf SLO preset that is its bar
(``launch.lab.loadgen_lib.slo``: interactive 450 / 40 ms, long 6 s / 175 ms, server 2 s / 200
ms, each times the run's ``slo_scale``), its Poisson arrival rate and request count.
``parse_segments(text)`` reads a comma list of names (empty: none, a quality-only check;
``ValueError`` on an unknown one).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Segment:
  name: str
  profile: str          # a loadgen profile
  length_scale: float   # multiplies the profile's lengths
  slo: str              # an MLPerf preset
  rate_per_s: float     # sessions per second
  requests: int         # sessions sent per run


SEGMENTS = {s.name: s for s in (
    # prompt 128 (16-1024), output 64 (4-256): chat turns
    Segment("interactive", "interactive", 0.5, "interactive", 1.0, 40),
    # prompt 1024 (256-4096), output 64 (8-256): documents, read once
    Segment("long_context", "long_context", 0.25, "long", 0.1, 8),
    # prompt 128 (8-1024), output 128 (16-512): offline-style jobs, loose bar
    Segment("batch", "batch", 0.25, "server", 0.5, 20),
    # 2-4 turns of prompt 128 + answers 48, a 1 s tool pause between turns: agents
    Segment("tool", "multi_turn", 0.5, "interactive", 0.3, 10),
)}


def parse_segments(text: str) -> tuple[Segment, ...]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in SEGMENTS]
  if unknown:
    raise ValueError(f"segments must be a comma list of {', '.join(SEGMENTS)}; got {text!r}")
  return tuple(SEGMENTS[n] for n in names)
