"""One model instance of the capacity simulator: the live scheduler's step plan, in counts.

Contract: ``Instance(name, role, spec, step_time, kv_tokens)`` holds the requests given to it
and plans one step at a time, as ``serving.scheduler.Scheduler.schedule`` does, but with token
counts instead of pages and ids:

* ``role`` ``mixed`` (interleaved): every decoding row gets one token first (its TPOT is the
  step), the rest of ``spec.max_step_tokens`` goes to prefill chunks of at most
  ``spec.max_chunk`` tokens, at most ``spec.max_prefill_chunks`` per step: sequences in the
  middle of their prompt first, then waiting requests FCFS while a slot (``spec.max_slots``)
  and KV are free. ``prefill``: the same without decode rows; a finished prompt leaves the slot
  (its first token is sampled) and its KV stays until ``release_kv`` (the transfer is done).
  ``decode``: requests arrive with their KV (``enqueue``) and join the decode batch, FCFS,
  while a slot and KV are free.
* KV: a request reserves ``prompt + output`` tokens (``prompt`` on a prefill instance) of the
  instance's ``kv_tokens`` when it takes a slot; the waiting queue's head blocks the others
  while it does not fit (the live scheduler allocates pages lazily and preempts instead: this
  is its no-preemption bound). A request needing more than ``kv_tokens`` is refused at arrival
  (``can_ever_fit``, like ``PagePool.can_ever_fit``).
* ``cached_tokens`` of a request (prefix-cache hits) are not prefilled but hold KV.
* ``start_step(now) -> seconds | None`` plans the next step (None: nothing to do) and
  ``end_step(now) -> StepEvents`` applies it: the requests whose first token or last token was
  produced (``Live.first_s`` / ``end_s`` = the step's end), and (prefill role) whose prompt is
  done. The live engine's ``lag=1`` returns a step's ids while the next step runs, i.e. when
  its device work ends: the host's planning overlaps the device, so a step costs its device
  time, and the ids are seen at the step's end as here; what the lag changes (a finished
  request's slot is reused one step later) is not modelled.
* Decode bookkeeping is O(1) per step: a row's finishing step is known when it joins, and the
  attended context of all rows is ``A + rows * step`` with ``A`` the sum of (context at join -
  join step).
* ``cost_model`` (when ``track_cost``) is the engine's online step model
  (``serving.step_cost.StepCostModel``) observing every busy step, for early rejection.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Literal

from launch.lab.simulator.step_time import StepTime
from serving.step_cost import StepCostModel

Role = Literal["mixed", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("mixed", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  max_slots: int = 64
  max_step_tokens: int = 512
  max_chunk: int = 256
  max_prefill_chunks: int = 4

  def __post_init__(self):
    if min(self.max_slots, self.max_step_tokens, self.max_chunk, self.max_prefill_chunks) < 1:
      raise ValueError("max_slots, max_step_tokens, max_chunk, max_prefill_chunks must be >= 1")


class Live:
  """A request in flight (mutable; the simulator's own record)."""

  __slots__ = ("index", "arrival_s", "prompt", "output", "cached", "left", "admitted_s",
               "first_s", "end_s", "finish_step", "instance", "decode_instance", "status")

  def __init__(self, index: int, arrival_s: float, prompt: int, output: int, cached: int):
    self.index, self.arrival_s = index, arrival_s
    self.prompt, self.output, self.cached = prompt, output, min(cached, prompt - 1)
    self.left = prompt - self.cached  # prompt tokens still to prefill
    self.admitted_s: float | None = None
    self.first_s: float | None = None
    self.end_s: float | None = None
    self.finish_step = -1
    self.instance = ""
    self.decode_instance = ""
    self.status = "ok"


@dataclasses.dataclass
class StepEvents:
  first: list[Live] = dataclasses.field(default_factory=list)  # first token sampled
  finished: list[Live] = dataclasses.field(default_factory=list)  # last token sampled
  prefilled: list[Live] = dataclasses.field(default_factory=list)  # prefill role: prompt done


class Instance:
  def __init__(self, name: str, role: Role, spec: EngineSpec, step_time: StepTime,
               kv_tokens: int, track_cost: bool = False):
    if role not in ROLES:
      raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if role == "mixed" and spec.max_slots > spec.max_step_tokens:
      raise ValueError("a mixed instance needs max_step_tokens >= max_slots (a token per row)")
    self.name, self.role, self.spec, self.step_time = name, role, spec, step_time
    self.kv_tokens = kv_tokens
    self.waiting: collections.deque[Live] = collections.deque()
    self.prefilling: list[Live] = []
    self.decoding = 0
    self._ctx_a = 0  # sum over decoding rows of (context at join - join step)
    self._finish: list[tuple[int, int, int, Live]] = []  # (finish step, index, A term, live)
    self.slots_used = 0
    self.kv_used = 0
    self.step = 0
    self.busy = False
    self.busy_s = 0.0
    self.steps_run = 0
    self.rows_sum = 0  # decode rows over all steps (mean batch = rows_sum / steps)
    self.prefill_tokens_sum = 0
    self.backlog_tokens = 0  # prompt tokens given to this instance, first token not yet out
    self.step_ema_s = 0.0
    self.cost_model = StepCostModel() if track_cost else None
    self._plan: list[tuple[Live, int]] = []
    self._rows = 0
    self._started = 0.0

  # -- arrivals --------------------------------------------------------------------------------

  def need(self, live: Live) -> int:
    return live.prompt if self.role == "prefill" else live.prompt + live.output

  def can_ever_fit(self, live: Live) -> bool:
    return self.need(live) <= self.kv_tokens

  def enqueue(self, live: Live) -> None:
    self.waiting.append(live)
    if self.role != "decode":
      self.backlog_tokens += live.left

  def release_kv(self, tokens: int) -> None:
    self.kv_used -= tokens

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.prefilling or self.decoding)

  @property
  def load(self) -> tuple[int, int]:
    """Dispatch key: the prefill tokens queued, then the rows held."""
    return (self.backlog_tokens, self.slots_used + len(self.waiting))

  def slot_wait_steps(self, ahead: int) -> int:
    """As ``Scheduler.slot_wait_steps``: steps until a slot frees for the ``ahead``-th waiter."""
    k = ahead - (self.spec.max_slots - self.slots_used)
    if k < 0 or not self._finish:
      return 0
    left = sorted(max(0, f - self.step) for f, *_ in self._finish)
    per_round = sum(left) / len(left)
    return int(left[k % len(left)] + (k // len(left)) * per_round)

  # -- steps -----------------------------------------------------------------------------------

  def _admit(self, now: float) -> Live | None:
    """The waiting queue's head, given a slot and its KV, or None (it stays at the head)."""
    live = self.waiting[0]
    need = self.need(live)
    if self.slots_used >= self.spec.max_slots or self.kv_used + need > self.kv_tokens:
      return None
    self.waiting.popleft()
    self.slots_used += 1
    self.kv_used += need
    if live.admitted_s is None:
      live.admitted_s = now
    return live

  def _join(self, live: Live, join_step: int, context: int, tokens: int) -> None:
    """``live`` decodes ``tokens`` ids from step ``join_step``, attending to ``context`` first."""
    self.decoding += 1
    a = context - join_step
    self._ctx_a += a
    live.finish_step = join_step + tokens - 1
    heapq.heappush(self._finish, (live.finish_step, live.index, a, live))

  def start_step(self, now: float) -> float | None:
    spec = self.spec
    plan: list[tuple[Live, int]] = []
    if self.role == "decode":
      while self.waiting and (live := self._admit(now)) is not None:
        self._join(live, self.step, live.prompt + 1, live.output - 1)
    else:
      budget = spec.max_step_tokens - self.decoding
      for live in self.prefilling:
        if budget < 1 or len(plan) >= spec.max_prefill_chunks:
          break
        n = min(live.left, spec.max_chunk, budget)
        plan.append((live, n))
        budget -= n
      while budget > 0 and self.waiting and len(plan) < spec.max_prefill_chunks:
        live = self._admit(now)
        if live is None:
          break
        self.prefilling.append(live)
        n = min(live.left, spec.max_chunk, budget)
        plan.append((live, n))
        budget -= n
    rows = self.decoding
    tokens = sum(n for _, n in plan)
    if not tokens and not rows:
      return None
    context = (self._ctx_a + rows * self.step) / rows if rows else 0.0
    seconds = self.step_time.seconds(tokens, rows, context)
    self._plan, self._rows, self._started = plan, rows, now
    self.busy = True
    self.steps_run += 1
    self.rows_sum += rows
    self.prefill_tokens_sum += tokens
    return seconds

  def end_step(self, now: float) -> StepEvents:
    """Applies the step planned by ``start_step``; ``now`` is its end."""
    s = self.step
    made = StepEvents()
    while self._finish and self._finish[0][0] <= s:
      _, _, a, live = heapq.heappop(self._finish)
      self.decoding -= 1
      self._ctx_a -= a
      self._free(live)
      made.finished.append(live)
    done = []
    for live, n in self._plan:
      live.left -= n
      if live.left == 0:
        done.append(live)
    if done:
      finished = set(map(id, done))
      self.prefilling = [x for x in self.prefilling if id(x) not in finished]
    for live in done:
      self.backlog_tokens -= live.prompt - live.cached
      made.first.append(live)
      if live.output == 1:
        self._free(live)
        made.finished.append(live)
      elif self.role == "prefill":
        self.slots_used -= 1  # its KV stays until the transfer is done (release_kv)
        made.prefilled.append(live)
      else:
        self._join(live, s + 1, live.prompt + 1, live.output - 1)
    dt = now - self._started
    self.busy_s += dt
    self.step_ema_s = 0.9 * self.step_ema_s + 0.1 * dt if self.step_ema_s else dt
    if self.cost_model is not None:
      self.cost_model.observe(sum(n for _, n in self._plan), self._rows, dt)
    self._plan, self.busy, self.step = [], False, s + 1
    return self._deliver(made, now)

  def _free(self, live: Live) -> None:
    self.slots_used -= 1
    self.kv_used -= self.need(live)

  def _deliver(self, made: StepEvents, now: float) -> StepEvents:
    for live in made.first:
      live.first_s = now
    for live in made.finished:
      live.end_s = now
    return made
