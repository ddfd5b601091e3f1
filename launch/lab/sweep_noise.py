"""How noisy is a partitioning sweep? Two runs of the same sweep, compared program by program.

  python -m launch.lab.sweep_partitioning ... --out results/sweep_a
  python -m launch.lab.sweep_partitioning ... --out /tmp/sweep_b      # the same flags again
  python -m launch.lab.sweep_noise --first results/sweep_a --second /tmp/sweep_b

For every program (cell x layout, shared programs once) timed in both runs: the run-to-run
change of its best time (deciles and median of |first / second - 1|), the repetition spread
within a run, and per band (the full range of a program's calls, the ``launch.lab.rank_agreement``
band, and the narrower [fastest, median] one) how many pairs of programs in a cell the first run
resolves and how many of those keep their order in the second: a band whose resolved pairs do
not reproduce is narrower than the machine's noise. Prints one JSON object; bad input exits 2.
"""

from __future__ import annotations

import json
import os
import statistics

from absl import flags

from launch import cli
from launch.lab import rank_agreement
from launch.cli import CliError

_FIRST = flags.DEFINE_string("first", None, "a launch.lab.sweep_partitioning output directory")
_SECOND = flags.DEFINE_string("second", None, "the same sweep run again")


def _rows(path: str) -> dict[tuple, dict]:
  try:
    with open(os.path.join(path, "sweep.json")) as f:
      rows = json.load(f)["rows"]
  except (OSError, ValueError, KeyError) as e:
    raise CliError(f"{path}: not a sweep output ({e})") from None
  out = {(r["phase"], r["batch"], r["seq"], r["weights"], r["ffn"], r["attn"]): r
         for r in rows if not r["same_as"] and r["measured_s"]}
  if any(len(r.get("reps_s") or ()) < 2 for r in out.values()):
    raise CliError(f"{path}: rows without two timed calls each (rerun with --reps >= 2)")
  return out


def _deciles(xs: list[float]) -> list[float]:
  return statistics.quantiles(xs, n=10) if len(xs) > 1 else list(xs)


def compare(first: dict[tuple, dict], second: dict[tuple, dict]) -> dict:
  common = [k for k in first if k in second]
  if not common:
    raise CliError("the two sweeps share no timed program")
  change = [abs(first[k]["measured_s"] / second[k]["measured_s"] - 1) for k in common]
  spread = [max(first[k]["reps_s"]) / min(first[k]["reps_s"]) - 1 for k in common]
  cells: dict[tuple, list[tuple]] = {}
  for k in common:
    cells.setdefault(k[:4], []).append(k)
  bands = {}
  for name, narrow in (("full_range", False), ("fastest_to_median", True)):
    res = same = 0
    for keys in cells.values():
      r, s = rank_agreement.reproduced([first[k]["reps_s"] for k in keys],
                                       [second[k]["measured_s"] for k in keys], narrow)
      res, same = res + r, same + s
    bands[name] = {"resolved_pairs": res, "same_order_in_second": same,
                   "reproduced": same / res if res else None}
  return {"programs": len(common), "cells": len(cells),
          "run_to_run_change": {"median": statistics.median(change), "deciles": _deciles(change)},
          "repetition_spread": {"median": statistics.median(spread), "deciles": _deciles(spread)},
          "bands": bands}


def main(argv: list[str]) -> None:
  cli.start(argv, required=("first", "second"))
  print(json.dumps({"bench": "sweep_noise", "first": _FIRST.value, "second": _SECOND.value,
                    **compare(_rows(_FIRST.value), _rows(_SECOND.value))}))


if __name__ == "__main__":
  cli.run(main)
