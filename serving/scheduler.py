"""Continuous batching policy: plan a step, let the engine run it, update from what it returns.

Contract (vLLM v1's loop; KV memory is the ``serving.kv_manager.KVManager`` at ``Scheduler.kv``):
  * ``add(request, trace)`` queues a request, or finishes it at once as ``rejected`` (queue
    full, over the context, more KV pages than a sub-pool could ever hold, bad sinks).
  * ``schedule() -> StepPlan``: one id for every decoding sequence first (the token budget bounds
    TPOT; ``prefill_limit(decode rows)`` may cap prefill further), then prompt chunks (at most
    ``max_chunk`` tokens, ``max_prefill_chunks`` per step): sequences mid-prompt, then waiting
    requests by priority (FCFS within one) while a slot is free (the lowest: slots stay compact).
  * When a decode lacks a page the lowest-priority running sequence (latest arrival among equals)
    is preempted and later recomputed (the same ids: sampling keys on seed and position); a
    prompt chunk preempts only a lower-priority sequence still in its prompt, else waits; a step
    that lacked pages admits no one. Sink sequences are never victims.
  * ``update(result)`` applies one ``StepResult`` through each request's ``StopChecker``; results
    may lag plans (``inflight`` ids); ``cancel`` is thread-safe; ``fail`` ends every running (and
    with ``waiting``, queued) request as ``error``. Lifecycle events go to the traces from ``add``.
Imports nothing from JAX: the plan (``serving.step_plan``, re-exported here) is plain data.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import threading
from typing import Callable

from models.text.tokenizer import Tokenizer
from serving.kv_manager import KVManager
from serving.kv_pages import PagePool, Refusal
from serving.lifecycle import RequestTrace
from serving.lora import LoraSlots
from serving.prefix_cache import BasePrefixCache
from serving.request import MAX_STREAM_TOKENS, Request, RequestOutput, TokenLogprobs, Usage
from serving.sessions import Sessions
from serving.speculative import DraftQuery, Proposer, SpecCounts, propose, speculable
from serving.step_plan import DecodeRow, PrefillChunk, SlotSetup, StepPlan, StepResult
from serving.stop import FinishReason, StopChecker


class _State(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  DONE = "done"


@dataclasses.dataclass(eq=False)
class _Seq:
  req: Request
  trace: RequestTrace
  checker: StopChecker
  order: int  # arrival order
  tokens: list[int]  # prompt + received generated ids
  state: _State = _State.WAITING
  computed: int = 0  # positions written (or planned to be) in the KV pages
  inflight: int = 0  # ids planned but not yet received
  slot: int = -1  # its decode row, -1 while it holds none
  decoding: bool = False  # the context's last chunk is planned: one id per step from now on
  preemptions: int = 0
  cached: int = 0  # prompt tokens reused at its first admission
  drafted: int = 0  # draft ids of its verification in flight (positions to give back)
  lora_slot: int = -1  # the device slot of its LoRA adapter while it runs (-1: none)

  @property
  def generated(self) -> int:
    return len(self.tokens) - len(self.req.prompt_ids)

  @property
  def key(self) -> tuple[int, int]:
    return (self.req.priority, self.order)  # smaller runs first


class Scheduler:
  """Plans steps over a ``KVManager``; see the module contract. ``kv`` may be a bare
  ``PagePool``: the manager is then built here over it, ``prefix_cache`` and ``sessions``."""

  def __init__(self, kv: KVManager | PagePool, tokenizer: Tokenizer, *, max_slots: int,
               max_step_tokens: int, max_chunk: int, max_waiting: int = 1024,
               max_context: int | None = None, max_prefill_chunks: int | None = None,
               prefix_cache: BasePrefixCache | None = None, cache_generated: bool = True,
               sessions: Sessions | None = None, sinks: bool = False,
               prefill_limit: Callable[[int], int | None] | None = None,
               proposer: Proposer | None = None, spec_max_rows: int = 4,
               loras: LoraSlots | None = None):
    if min(max_slots, max_step_tokens, max_chunk, max_waiting) < 1:
      raise ValueError("max_slots, max_step_tokens, max_chunk and max_waiting must be >= 1")
    if isinstance(kv, PagePool):
      kv = KVManager(kv, prefix_cache, sessions=sessions, cache_generated=cache_generated)
    elif prefix_cache is not None or sessions is not None or not cache_generated:
      raise ValueError("prefix_cache, sessions and cache_generated belong to the KVManager")
    self.kv = kv
    self.tokenizer = tokenizer
    self.max_slots = max_slots
    self.max_step_tokens = max_step_tokens
    self.max_chunk = max_chunk
    self.max_waiting = max_waiting
    self.max_context = min(max_context or kv.max_seq_tokens, kv.max_seq_tokens)
    # Chunks per step (bounds the prefill rows bucket, hence the programs to warm up).
    self.max_prefill_chunks = max(1, min(max_prefill_chunks or max_slots, max_slots))
    self.sinks = sinks
    self.prefill_limit = prefill_limit
    self.proposer = proposer
    self.spec_max_rows = spec_max_rows  # speculate while at most this many sequences decode
    self.spec = SpecCounts()
    self.loras = loras  # multi-LoRA: the device's adapter slots (None: no adapters served)
    self.last_prefill_limit: int | None = None  # what prefill_limit said for the last plan
    self._seqs: dict[str, _Seq] = {}
    self._waiting: list[tuple[int, int, str]] = []  # heap of (priority, order, id)
    self._running: list[_Seq] = []
    self._free_slots = list(range(max_slots))  # a heap: lowest slot first
    self._order = itertools.count()
    self._step = 0
    self._short = False
    self._cancel_lock = threading.Lock()
    self._cancelled: list[str] = []
    self._outputs: list[RequestOutput] = []

  # -- arrivals and cancellations -------------------------------------------------------------

  def add(self, req: Request, trace: RequestTrace) -> RequestOutput | None:
    """Queues ``req``; returns its final output when it is rejected at arrival."""
    if req.request_id in self._seqs:
      raise ValueError(f"duplicate request id {req.request_id!r}")
    need = len(req.prompt_ids) + req.stop.max_tokens
    reason = None
    if len(self._waiting) >= self.max_waiting:
      reason = f"the waiting queue is full ({self.max_waiting} requests)"
    elif req.sinks is not None:
      reason = self._sinks_refusal(req)
    elif req.lora is not None and self.loras is None:
      reason = f"LoRA adapter {req.lora.name!r} requested, but this server serves none"
    elif need > self.max_context:
      reason = (f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.stop.max_tokens}) "
                f"exceeds the context ({self.max_context} tokens)")
    else:
      refusal = self.kv.can_ever_fit(need)
      if refusal is not None:
        reason = refusal.message
    if reason is not None:
      trace.record("finished", FinishReason.REJECTED.value)
      return RequestOutput(req.request_id, finish_reason=FinishReason.REJECTED, message=reason,
                           usage=Usage(len(req.prompt_ids), 0))
    seq = _Seq(req, trace, StopChecker(self.tokenizer, req.stop), next(self._order),
               list(req.prompt_ids))
    self._seqs[req.request_id] = seq
    heapq.heappush(self._waiting, (req.priority, seq.order, req.request_id))
    trace.record("queued")
    return None

  def _sinks_refusal(self, req: Request) -> str | None:
    """A sink stream (a ring of pages from admission) may run past the context up to
    ``MAX_STREAM_TOKENS``, but its prompt must fit in sinks + window and its sinks in a page."""
    s, z = req.sinks, self.kv.page_size
    assert s is not None
    if not self.sinks:
      return "attention sinks need a server started with --attention_sinks"
    if s.sinks > z:
      return f"sinks ({s.sinks}) must fit in one KV page ({z} positions)"
    if len(req.prompt_ids) > s.sinks + s.window:
      return (f"prompt ({len(req.prompt_ids)} tokens) exceeds sinks + window "
              f"({s.sinks} + {s.window}): the prefill does not roll the window")
    if req.stop.max_tokens > MAX_STREAM_TOKENS:
      return f"max_tokens ({req.stop.max_tokens}) exceeds a stream's {MAX_STREAM_TOKENS}"
    refusal = self.kv.can_ever_fit(0, s)
    return refusal.message if refusal else None

  def cancel(self, request_id: str) -> None:
    """Thread-safe: its pages and slot are free before the next plan; it ends ``cancelled``."""
    with self._cancel_lock:
      self._cancelled.append(request_id)

  # -- planning ---------------------------------------------------------------------------------

  @property
  def idle(self) -> bool:
    return not self._seqs

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def num_running(self) -> int:
    return len(self._running)

  @property
  def num_decoding(self) -> int:
    return sum(s.decoding for s in self._running)

  @property
  def synchronous(self) -> bool:
    """Speculation wants each step's ids before the next plan (the driver flushes a lagged
    engine): few enough sequences decode for drafts (``spec_max_rows``), one of them may."""
    return (self.proposer is not None and 0 < self.num_decoding <= self.spec_max_rows
            and any(s.decoding and speculable(s.req) for s in self._running))

  def slot_wait_steps(self, ahead: int) -> int:
    """About how many steps until a slot is free for a request with ``ahead`` others waiting
    before it: the running sequences' remaining ids, the earliest to finish first (each later
    waiter takes the slot after the one before; a snapshot, read from any thread)."""
    free = self.max_slots - len(self._running)
    k = ahead - free
    if k < 0:
      return 0
    left = sorted(max(0, s.req.stop.max_tokens - s.generated) for s in list(self._running))
    if not left:
      return 0
    per_round = sum(left) / len(left)  # a slot cycles about once per mean length
    return int(left[k % len(left)] + (k // len(left)) * per_round)

  def schedule(self) -> StepPlan:
    self._apply_cancellations()
    self.kv.expire_sessions()
    budget = self.max_step_tokens
    self._short = False  # a running sequence lacked pages this step (see _reserve)
    decode: list[DecodeRow] = []
    prefill: list[PrefillChunk] = []
    setups: list[SlotSetup] = []
    order = sorted(self._running, key=lambda s: s.key)
    drafts = self._drafts(order, budget) if self.synchronous else {}
    for seq in order:
      if seq.state is not _State.RUNNING or not seq.decoding or budget < 1 or seq.drafted:
        continue
      if seq.generated + seq.inflight >= seq.req.stop.max_tokens:
        continue  # its last id is in flight; nothing more to compute
      draft = drafts.get(seq.req.request_id, ())[:budget - 1]
      if draft and self.kv.extend(seq.req.request_id, 1 + len(draft)) is not None:
        draft = ()  # no room for the drafts now: a plain decode (which may preempt)
      if not draft and not self._reserve(seq, 1, preempt=True):
        continue
      decode.append(DecodeRow(seq.req.request_id, seq.slot, seq.computed, draft))
      seq.computed += 1 + len(draft)
      seq.drafted = len(draft)
      seq.inflight += 1
      budget -= 1 + len(draft)
    self.last_prefill_limit = None
    if decode and self.prefill_limit is not None:
      limit = self.last_prefill_limit = self.prefill_limit(len(decode))
      if limit is not None:
        budget = min(budget, limit)
    for seq in sorted(self._running, key=lambda s: s.key):
      if budget < 1 or len(prefill) >= self.max_prefill_chunks:
        break
      if seq.state is _State.RUNNING and not seq.decoding:
        budget -= self._plan_chunk(seq, budget, prefill)
    skipped: list[tuple[int, int, str]] = []  # their adapters wait for a device slot
    while (budget > 0 and self._waiting and self._free_slots and not self._short
           and len(prefill) < self.max_prefill_chunks):
      _, _, rid = self._waiting[0]
      seq = self._seqs[rid]
      if seq.inflight:  # preempted with an id still in flight: wait for it
        break
      if not self._acquire_lora(seq):
        skipped.append(heapq.heappop(self._waiting))  # later requests of other adapters may run
        continue
      got = self.kv.admit(seq.req, seq.tokens, min(budget, self.max_chunk),
                          first=not seq.preemptions)
      if got is None:
        self._release_lora(seq)
        break  # no pages now: admit later (running sequences are never preempted for this)
      seq.computed = got.start
      if not seq.preemptions:
        seq.cached = got.start
      heapq.heappop(self._waiting)
      seq.slot = heapq.heappop(self._free_slots)
      seq.state = _State.RUNNING
      self._running.append(seq)
      setups.append(self._setup(seq))
      if seq.preemptions:
        seq.trace.record("resumed")
      if got.paused_at is not None:  # a session's next turn: its path is locked by seq now
        seq.trace.record("paused", seq.req.session_id, t=got.paused_at)
        seq.trace.record("resume", f"{got.start} cached tokens")
      budget -= self._plan_chunk(seq, budget, prefill, reserved=True)
    for item in skipped:
      heapq.heappush(self._waiting, item)
    self._step += 1
    seqs: list[str | None] = [None] * self.max_slots
    for seq in self._running:
      seqs[seq.slot] = seq.req.request_id
    moves = self.kv.take_moves()
    return StepPlan(self._step, tuple(prefill), tuple(decode), tuple(setups),
                    self.kv.page_table(seqs), moves.copies, spills=moves.spills,
                    forget=moves.forget, loads=moves.loads,
                    lora_loads=self.loras.take_loads() if self.loras is not None else ())

  def lora_info(self) -> tuple[int, list[str], list[str], int] | None:
    """(device slots, adapters of running sequences, of waiting ones, adapters moved onto the
    device so far); None without adapters. Read from other threads (metrics): copies only."""
    if self.loras is None:
      return None
    running = sorted({s.req.lora.name for s in list(self._running) if s.req.lora is not None})
    waiting = set()
    for _, _, rid in list(self._waiting):
      seq = self._seqs.get(rid)
      if seq is not None and seq.req.lora is not None:
        waiting.add(seq.req.lora.name)
    return self.loras.max_loras, running, sorted(waiting), self.loras.loads

  def _acquire_lora(self, seq: _Seq) -> bool:
    """Its adapter's device slot (``seq.lora_slot``); False while every slot serves others."""
    if seq.req.lora is None:
      return True
    assert self.loras is not None, "checked at arrival"
    slot = self.loras.acquire(seq.req.lora)
    if slot is None:
      return False
    seq.lora_slot = slot
    return True

  def _release_lora(self, seq: _Seq) -> None:
    if seq.lora_slot >= 0:
      assert self.loras is not None
      self.loras.release(seq.lora_slot)
      seq.lora_slot = -1

  def _drafts(self, order: list[_Seq], budget: int) -> dict[str, tuple[int, ...]]:
    """One proposer call's drafts for the decoding sequences with no id in flight: at most what
    max_tokens leaves after the step's own id and the budget after the rows before (a proposer
    that fails turns speculation off for this scheduler: ``speculative.propose``)."""
    assert self.proposer is not None
    queries = []
    for seq in order:
      if (seq.state is _State.RUNNING and seq.decoding and not seq.drafted and not seq.inflight
          and speculable(seq.req)):
        k = min(self.proposer.k, seq.req.stop.max_tokens - seq.generated - 1, budget - 1)
        budget -= 1 + max(k, 0)
        if k > 0:
          queries.append(DraftQuery(seq.req.request_id, seq.tokens, k))
    got = propose(self.proposer, queries, self.spec)
    if got is None:
      self.proposer = None
    return got or {}

  def _setup(self, seq: _Seq) -> SlotSetup:
    """The slot's setup; a penalised or constrained request's carries its ids (its penalty
    counts' start, its grammar's replay)."""
    req = seq.req
    if not (req.sampling.penalized or req.sampling.grammar is not None):
      return SlotSetup(seq.slot, req.request_id, req.sampling, req.sinks, lora=seq.lora_slot)
    n = len(req.prompt_ids)
    return SlotSetup(seq.slot, req.request_id, req.sampling, req.sinks, req.prompt_ids,
                     tuple(seq.tokens[n:]), lora=seq.lora_slot)

  def _plan_chunk(self, seq: _Seq, budget: int, out: list[PrefillChunk],
                  reserved: bool = False) -> int:
    """Plans the next prompt chunk of ``seq``; returns the tokens used."""
    n = min(budget, self.max_chunk, len(seq.tokens) - seq.computed)
    if n < 1:
      return 0
    if not reserved and not self._reserve(seq, n, preempt=False):
      return 0
    start = seq.computed
    sample = start + n == len(seq.tokens)
    out.append(PrefillChunk(seq.req.request_id, seq.slot, tuple(seq.tokens[start:start + n]),
                            start, sample))
    seq.computed += n
    if sample:
      seq.inflight += 1
      seq.decoding = True
    return n

  def _reserve(self, seq: _Seq, n: int, preempt: bool) -> bool:
    """Pages for ``n`` more positions of a running ``seq``. A decode (``preempt``) preempts
    lower-priority sequences (not planned yet: decodes run in priority order), else yields
    itself; a prefill chunk preempts only a lower-priority one still in its prompt, else waits
    keeping its pages (two long prompts must not each hold half the pool forever). Any shortage
    stops admissions for the step (``_short``): a new request would take those pages."""
    while True:
      refusal = self.kv.extend(seq.req.request_id, n)  # reclaims cached pages first
      if refusal is None:
        return True
      if refusal.kind != "no_pages":
        self._finish(seq, FinishReason.LENGTH, refusal.message)
        return False
      self._short = True
      victim = self._victim(seq, prefilling_only=not preempt)
      if victim is None:
        if preempt:
          self._preempt(seq)
        return False
      self._preempt(victim)

  def _victim(self, seq: _Seq, prefilling_only: bool = False) -> _Seq | None:
    shard = self.kv.shard_of(seq.req.request_id)
    cands = [s for s in self._running if s.key > seq.key and s.req.sinks is None
             and self.kv.shard_of(s.req.request_id) == shard
             and not (prefilling_only and s.decoding)]
    return max(cands, key=lambda s: s.key, default=None)

  def _preempt(self, seq: _Seq) -> None:
    self._drop_running(seq)
    seq.state = _State.WAITING
    seq.computed = 0
    seq.decoding = False
    seq.drafted = 0  # its pages are gone; its accepted ids, when they come, are still its own
    seq.preemptions += 1
    seq.trace.record("preempted")
    heapq.heappush(self._waiting, (seq.req.priority, seq.order, seq.req.request_id))

  def _drop_running(self, seq: _Seq) -> None:
    self.kv.free(seq.req.request_id)
    self._release_lora(seq)
    if seq.slot >= 0:
      heapq.heappush(self._free_slots, seq.slot)
      seq.slot = -1
    if seq in self._running:
      self._running.remove(seq)

  # -- results ----------------------------------------------------------------------------------

  def update(self, result: StepResult) -> list[RequestOutput]:
    for rid, tok in result.tokens.items():
      seq = self._seqs.get(rid)
      if seq is None or seq.state is _State.DONE:
        continue
      seq.inflight -= 1
      accepted = result.accepted.get(rid, ())
      if seq.drafted:  # the rejected drafts' positions go back (pages that empty: freed)
        self.spec.record(seq.drafted, len(accepted))
        seq.computed -= seq.drafted - len(accepted)
        seq.drafted = 0
        self.kv.shrink(rid, seq.computed)
      ids: list[int] = []
      text = ""
      for t in (*accepted, tok):
        seq.tokens.append(int(t))
        ids.append(int(t))
        seq.trace.record("first_token" if seq.generated == 1 else "token")
        if seq.generated == 1:  # the step that wrote the prompt has run: share its pages
          self.kv.cache(rid, seq.tokens[:len(seq.req.prompt_ids)])
        step = seq.checker.push(t)
        text += step.text
        if step.finish is not None:
          break
      lp = (result.logprobs[rid],) if rid in result.logprobs else ()
      if step.finish is not None:
        self._finish(seq, step.finish, "", tuple(ids), text, lp)
      else:
        self._outputs.append(RequestOutput(rid, tuple(ids), text, logprobs=lp))
    out, self._outputs = self._outputs, []
    return out

  def _finish(self, seq: _Seq, reason: FinishReason, message: str,
              ids: tuple[int, ...] = (), text: str = "",
              lp: tuple[TokenLogprobs, ...] = ()) -> None:
    if reason is not FinishReason.ERROR and seq.state is _State.RUNNING:
      self.kv.finish(seq.req.request_id, seq.tokens)  # cached; a session's turn stays pinned
    self._drop_running(seq)
    if seq.state is _State.WAITING:
      self._waiting = [w for w in self._waiting if w[2] != seq.req.request_id]
      heapq.heapify(self._waiting)
    seq.state = _State.DONE
    if self.proposer is not None:
      self.proposer.forget(seq.req.request_id)
    seq.trace.record("finished", reason.value)
    del self._seqs[seq.req.request_id]
    self._outputs.append(RequestOutput(
        seq.req.request_id, ids, text, reason, message,
        Usage(len(seq.req.prompt_ids), seq.generated, seq.cached), lp,
        seq.checker.stop_reason))

  def _apply_cancellations(self) -> None:
    with self._cancel_lock:
      cancelled, self._cancelled = self._cancelled, []
    for rid in cancelled:
      seq = self._seqs.get(rid)
      if seq is not None:
        self._finish(seq, FinishReason.CANCELLED, "cancelled by the client")

  def fail(self, message: str, waiting: bool = False) -> list[RequestOutput]:
    """After an engine fault: see the module contract."""
    self.kv.drop_cached()  # pages a failed step was writing must not be reused
    for seq in list(self._seqs.values()):
      seq.inflight = 0  # whatever was in flight is lost with the failed step
      if seq.state is _State.RUNNING or waiting:
        self._finish(seq, FinishReason.ERROR, message)
    return self.drain_outputs()

  def drain_outputs(self) -> list[RequestOutput]:
    """Outputs produced outside ``update`` (cancellations, length stops while planning)."""
    out, self._outputs = self._outputs, []
    return out


__all__ = ["PrefillChunk", "DecodeRow", "SlotSetup", "StepPlan", "StepResult", "Scheduler",
           "Refusal"]
