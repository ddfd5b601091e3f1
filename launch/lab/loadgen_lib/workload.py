"""What the load generator sends: sessions of turns, from a length profile or a trace file.

Contract: ``build_sessions(cfg, arrival_s, rng)`` gives one ``SessionSpec`` per arrival; every
request is a session (most have one turn). A turn's prompt is the previous turn's prompt + its
answer + the turn's ``new_ids`` (the runner builds it, the answer is known only then); a later
turn is sent ``pause_s`` after the previous one ended (a tool call), so sessions arrive open-loop
and their turns follow each other. ``load_trace(path)`` reads a JSONL or CSV trace.

Profiles (token counts as median, s = sigma, [lo, hi]: a length is ``median * exp(sigma *
N(0, 1))`` rounded and clipped to ``[lo, hi]``; ``length_scale`` multiplies medians, bounds and
the shared prefix):

* ``interactive``: prompt 256, s 0.7, [16, 2048]; output 128, s 0.6, [8, 512]; SLO interactive.
* ``long_context``: prompt 4096, s 0.5, [1024, 16384]; output 256, s 0.5, [32, 1024]; SLO long.
* ``batch``: prompt 512, s 0.8, [32, 4096]; output 512, s 0.6, [64, 2048]; SLO server.
* ``shared_prefix``: one prefix of 1024 ids common to every request + a suffix of 64, s 0.5,
  [8, 256]; output 64, s 0.5, [8, 256]; SLO interactive.
* ``multi_turn``: 2-4 turns (uniform); turn 1's prompt 256, s 0.6, [32, 1024], each later turn
  adds 48, s 0.6, [8, 256] new ids; output 96, s 0.6, [8, 256] per turn; a tool pause before
  each later turn, exponential with mean 1 s; SLO interactive.

Prompt ids are uniform over ``[lo_id, vocab_size)`` (``lo_id`` = min(100, vocab / 4), clear of
special ids), distinct per request; text APIs get them as words (``ids_to_text``: one word per
id). With ``max_context`` > 0 a prompt is shortened to fit ``prompt + output <= max_context`` and
a session's turns stop before their predicted prompt (answers at full length) would not fit;
``clipped`` counts both.

A trace row (JSONL object or CSV row) holds ``arrival_s`` (seconds from the start),
``prompt_len`` and ``output_len``; each row is one single-turn request.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math

import numpy as np

# Short common English words (one token each in BPE vocabularies of Llama-like models).
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "as", "with", "by", "at",
         "from", "his", "an", "are", "which", "this", "be", "or", "has", "but", "were", "not",
         "had", "one", "also", "first", "new", "after", "who", "its", "time", "two", "their",
         "all", "been", "she", "year", "can", "more", "other", "city", "when", "into", "most",
         "made", "over", "only", "three", "used", "school", "part", "world", "may", "some",
         "name", "then", "state", "many", "where", "later", "would")


def ids_to_text(ids) -> str:
  return "".join(" " + WORDS[i % len(WORDS)] for i in ids)


@dataclasses.dataclass(frozen=True)
class LengthDist:
  median: float
  sigma: float
  lo: int
  hi: int

  def sample(self, rng: np.random.Generator, scale: float) -> int:
    lo = max(1, round(self.lo * scale))
    hi = max(lo, round(self.hi * scale))
    x = self.median * scale * math.exp(self.sigma * rng.standard_normal())
    return int(min(hi, max(lo, round(x))))


@dataclasses.dataclass(frozen=True)
class Profile:
  name: str
  prompt: LengthDist
  output: LengthDist
  slo: str
  shared_prefix_len: int = 0
  min_turns: int = 1
  max_turns: int = 1
  followup: LengthDist | None = None
  tool_pause_mean_s: float = 0.0


PROFILES = {p.name: p for p in (
    Profile("interactive", LengthDist(256, 0.7, 16, 2048), LengthDist(128, 0.6, 8, 512),
            "interactive"),
    Profile("long_context", LengthDist(4096, 0.5, 1024, 16384), LengthDist(256, 0.5, 32, 1024),
            "long"),
    Profile("batch", LengthDist(512, 0.8, 32, 4096), LengthDist(512, 0.6, 64, 2048), "server"),
    Profile("shared_prefix", LengthDist(64, 0.5, 8, 256), LengthDist(64, 0.5, 8, 256),
            "interactive", shared_prefix_len=1024),
    Profile("multi_turn", LengthDist(256, 0.6, 32, 1024), LengthDist(96, 0.6, 8, 256),
            "interactive", min_turns=2, max_turns=4, followup=LengthDist(48, 0.6, 8, 256),
            tool_pause_mean_s=1.0),
)}


@dataclasses.dataclass(frozen=True)
class TraceRow:
  arrival_s: float
  prompt_len: int
  output_len: int


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
  profile: str = "interactive"           # a PROFILES name, or "trace"
  length_scale: float = 1.0
  vocab_size: int = 32000
  max_context: int = 0                   # 0: no clipping
  tool_pause_mean_s: float | None = None  # None: the profile's


@dataclasses.dataclass(frozen=True)
class Turn:
  new_ids: tuple[int, ...]
  max_tokens: int
  pause_s: float


@dataclasses.dataclass(frozen=True)
class SessionSpec:
  index: int
  arrival_s: float
  turns: tuple[Turn, ...]
  session_id: str  # "" for a single-turn request


@dataclasses.dataclass(frozen=True)
class Workload:
  sessions: tuple[SessionSpec, ...]
  clipped: int

  @property
  def requests(self) -> int:
    return sum(len(s.turns) for s in self.sessions)


def _ids(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
  lo = min(100, vocab // 4)
  return tuple(int(x) for x in rng.integers(lo, vocab, n))


def _fit(prompt: int, output: int, max_context: int) -> tuple[int, int, bool]:
  if not max_context or prompt + output <= max_context:
    return prompt, output, False
  output = min(output, max_context - 1)
  return max(1, max_context - output), output, True


def build_sessions(cfg: WorkloadConfig, arrival_s: np.ndarray, rng: np.random.Generator,
                   trace: tuple[TraceRow, ...] = ()) -> Workload:
  if cfg.profile == "trace":
    if len(trace) != len(arrival_s):
      raise ValueError("a trace workload needs one arrival per trace row")
    out, clipped = [], 0
    for i, (row, t) in enumerate(zip(trace, arrival_s)):
      p, o, c = _fit(row.prompt_len, row.output_len, cfg.max_context)
      clipped += c
      out.append(SessionSpec(i, float(t), (Turn(_ids(rng, p, cfg.vocab_size), o, 0.0),), ""))
    return Workload(tuple(out), clipped)
  if cfg.profile not in PROFILES:
    raise ValueError(f"profile {cfg.profile!r} is not one of {', '.join(PROFILES)} or trace")
  prof = PROFILES[cfg.profile]
  k = cfg.length_scale
  pause_mean = prof.tool_pause_mean_s if cfg.tool_pause_mean_s is None else cfg.tool_pause_mean_s
  prefix = _ids(rng, round(prof.shared_prefix_len * k), cfg.vocab_size)
  sessions, clipped = [], 0
  for i, t in enumerate(arrival_s):
    n_turns = int(rng.integers(prof.min_turns, prof.max_turns + 1))
    turns: list[Turn] = []
    context = 0
    for j in range(n_turns):
      dist = prof.prompt if j == 0 else prof.followup
      new, o = dist.sample(rng, k), prof.output.sample(rng, k)
      pause = float(rng.exponential(pause_mean)) if j and pause_mean > 0 else 0.0
      if j == 0:
        p, o, c = _fit(len(prefix) + new, o, cfg.max_context)
        clipped += c
        ids = (prefix + _ids(rng, max(0, p - len(prefix)), cfg.vocab_size))[:p]
      else:
        if cfg.max_context and context + new + o > cfg.max_context:
          clipped += 1
          break
        ids = _ids(rng, new, cfg.vocab_size)
      turns.append(Turn(ids, o, pause))
      context += len(ids) + o
    sessions.append(SessionSpec(i, float(t), tuple(turns), f"s{i}" if n_turns > 1 else ""))
  return Workload(tuple(sessions), clipped)


def _row(d: dict, where: str) -> TraceRow:
  try:
    row = TraceRow(float(d["arrival_s"]), int(d["prompt_len"]), int(d["output_len"]))
  except (KeyError, ValueError, TypeError) as e:
    raise ValueError(f"{where}: needs arrival_s, prompt_len, output_len ({e})") from None
  if row.arrival_s < 0 or row.prompt_len < 1 or row.output_len < 1:
    raise ValueError(f"{where}: arrival_s >= 0, prompt_len and output_len >= 1")
  return row


def load_trace(path: str) -> tuple[TraceRow, ...]:
  with open(path, newline="", encoding="utf-8") as f:
    if path.endswith(".csv"):
      rows = [_row(d, f"{path}:{i + 2}") for i, d in enumerate(csv.DictReader(f))]
    else:
      rows = [_row(json.loads(line), f"{path}:{i + 1}") for i, line in enumerate(f)
              if line.strip()]
  if not rows:
    raise ValueError(f"{path}: an empty trace")
  return tuple(sorted(rows, key=lambda r: r.arrival_s))
