"""Continuous batching: plan a step, let the engine run it, update from what it returns.

Contract (vLLM v1's loop; the engine is ``serving.engine``, or any object running ``StepPlan``s):
  * ``add(request, trace)`` admits a request to the bounded waiting queue, or finishes it at
    once as ``rejected`` with a reason: queue full, prompt + max_tokens over the context, or more
    KV pages than its sub-pool could ever hold (``PagePool.can_ever_fit``).
  * ``cancel(request_id)`` is thread-safe; the request's pages and slot are free before the next
    step planned after the call, and it finishes as ``cancelled``.
  * ``schedule() -> StepPlan``: every running, decoding sequence gets one token (decode first:
    their TPOT is the step time, which the token budget bounds); the rest of
    ``max_step_tokens`` goes to prefill chunks (at most ``max_chunk`` tokens each, at most
    ``max_prefill_chunks`` per step; when the step decodes and ``prefill_limit`` is set, at
    most ``prefill_limit(decode rows)`` prefill tokens in all, None meaning no limit: the
    TPOT-aware budget of ``serving.step_cost.tpot_prefill_limit``; ``last_prefill_limit`` is
    what it said for the last plan): sequences in
    the middle of their prompt first, then waiting requests by priority, FCFS within one, while a
    slot (a row of the decode batch; the lowest free one, so active slots stay compact) is free.
    Pages come from the ``PagePool`` before the step that writes them. When a decode cannot get a
    page, the running sequence with the lowest priority (latest arrival among equals) is
    preempted: its pages are freed and it is recomputed later from its prompt and the tokens it
    already generated (the same tokens: sampling keys on seed and position). A prompt chunk
    that cannot get a page preempts the lowest-priority sequence still in its prompt, if one
    ranks below it, else waits; a step in which a running sequence lacked pages admits no new
    request (as vLLM v1). A sequence that
    would pass its page capacity or the context finishes as ``length`` with a message.
  * ``update(result) -> list[RequestOutput]`` applies one ``StepResult``: each sampled id goes
    through the request's ``StopChecker``; finished requests release pages and slot at once.
    Results may lag plans (the engine copies tokens to the host a step behind): a sequence
    keeps ``inflight`` ids planned but not yet received; ids arriving for a finished request
    are dropped; a preempted request is re-admitted only once nothing of it is in flight.
  * Lifecycle events (``serving.lifecycle``) are recorded on the traces given to ``add``.
  * Prefix cache (optional ``prefix_cache``, ``serving.prefix_cache``): an admitted request
    reuses the longest cached run of whole pages of its context (on the sub-pool holding it,
    when that sub-pool has room; else its device pages are copied into another sub-pool, the
    plan's ``copies``, counted in ``prefix_copied_pages``) and prefills only the rest;
    pages in the host tier are loaded back onto its first fresh pages (the plan's ``loads``),
    and pages the cache evicts to the host are the plan's ``spills``, copied out before the
    step may write them;
    its path is locked while it runs. A sequence's prompt pages are cached when its first id
    arrives (the step that wrote them has run), its prompt + generated pages when it ends
    (``cache_generated``; False when decode writes another pool than prefill reads, so only
    prompt pages are cached). Pages are reclaimed from the cache (LRU unlocked leaves) before
    a request waits or a running sequence is preempted. ``Usage.cached_tokens`` counts the
    reused prompt tokens of the first admission.
  * Sessions (optional ``sessions``, ``serving.sessions``): a request with a ``session_id`` that
    ends keeps its prompt + generated pages pinned (locked in the cache) for the session's next
    turn, within the sessions' idle time and page budget; the next turn's admission takes the
    pin (its own match locks the path) and its trace records ``paused`` (when the previous turn
    ended) and ``resume``.
  * ``fail(message, waiting=False)`` ends every running sequence (and, with ``waiting``, every
    queued one) as ``error`` after an engine fault: pages and slots are released and nothing is
    left in flight; it returns the outputs at once.
  * Attention sinks (``Request.sinks``, when built with ``sinks=True``: the engine runs a
    sink pool): the request's sequence is a ring of ``ring_entries(window, page_size)``
    pages from admission (``PagePool`` ring sequences), so it may run past the context for as
    many tokens as ``max_tokens`` asks (up to ``MAX_STREAM_TOKENS``); its prompt must fit in
    ``sinks + window`` (prefill does not roll the window) and ``sinks`` in a page. It neither
    uses nor feeds the prefix cache and sessions, and is never a preemption victim (its
    recomputation would not be the same stream once the window has rolled).
  * ``idle`` is True when nothing is waiting, running or in flight.
Imports nothing from JAX: the plan is plain data.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import threading
from typing import Callable, Sequence

import numpy as np

from models.text.tokenizer import Tokenizer
from serving.kv_pages import PageCopy, PagePool, Refusal, ring_entries
from serving.lifecycle import RequestTrace
from serving.prefix_cache import Match, PageLoad, PageSpill, PrefixCache
from serving.sessions import Sessions
from serving.request import (MAX_STREAM_TOKENS, Request, RequestOutput, Sinks, TokenLogprobs,
                             Usage)
from serving.sampling import SamplingParams
from serving.stop import FinishReason, StopChecker


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
  request_id: str
  slot: int
  token_ids: tuple[int, ...]
  start: int  # absolute position of token_ids[0]
  sample: bool  # the context ends with this chunk: sample the sequence's next id


@dataclasses.dataclass(frozen=True)
class DecodeRow:
  request_id: str
  slot: int
  position: int  # where the slot's last sampled id (held on the device) is written


@dataclasses.dataclass(frozen=True)
class SlotSetup:
  slot: int
  request_id: str
  sampling: SamplingParams
  sinks: Sinks | None = None  # the slot's cache policy (a sink pool's per-row sinks/window)


@dataclasses.dataclass(frozen=True)
class StepPlan:
  step: int
  prefill: tuple[PrefillChunk, ...]
  decode: tuple[DecodeRow, ...]
  setups: tuple[SlotSetup, ...]  # slots (re)assigned this step: reset their sampling state
  page_table: np.ndarray  # [max_slots, max_pages_per_seq] int32; free slots hold the null page
  copies: tuple[PageCopy, ...] = ()
  # Host tier, in this order before the step: device pages to copy out, host entries to drop,
  # host entries to load onto device pages.
  spills: tuple[PageSpill, ...] = ()
  forget: tuple[int, ...] = ()
  loads: tuple[PageLoad, ...] = ()

  @property
  def num_tokens(self) -> int:
    return len(self.decode) + sum(len(c.token_ids) for c in self.prefill)

  @property
  def empty(self) -> bool:
    return not self.prefill and not self.decode


@dataclasses.dataclass(frozen=True)
class StepResult:
  step: int
  tokens: dict[str, int]  # request id -> id sampled by this step
  logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)


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
  slot: int | None = None
  decoding: bool = False  # the context's last chunk is planned: one id per step from now on
  preemptions: int = 0
  match: Match | None = None  # the cached prefix it reuses (locked while it runs)
  cached: int = 0  # prompt tokens reused at its first admission

  @property
  def generated(self) -> int:
    return len(self.tokens) - len(self.req.prompt_ids)

  @property
  def key(self) -> tuple[int, int]:
    return (self.req.priority, self.order)  # smaller runs first

  def ring(self, page_size: int) -> int:
    """Pages of its ring (attention sinks), 0 for a whole-context sequence."""
    return ring_entries(self.req.sinks.window, page_size) if self.req.sinks else 0


class Scheduler:
  """Plans steps over a ``PagePool``; see the module contract."""

  def __init__(self, pool: PagePool, tokenizer: Tokenizer, *, max_slots: int,
               max_step_tokens: int, max_chunk: int, max_waiting: int = 1024,
               max_context: int | None = None, max_prefill_chunks: int | None = None,
               prefix_cache: PrefixCache | None = None, cache_generated: bool = True,
               sessions: Sessions | None = None, sinks: bool = False,
               prefill_limit: Callable[[int], int | None] | None = None):
    if min(max_slots, max_step_tokens, max_chunk, max_waiting) < 1:
      raise ValueError("max_slots, max_step_tokens, max_chunk and max_waiting must be >= 1")
    self.pool = pool
    self.tokenizer = tokenizer
    self.max_slots = max_slots
    self.max_step_tokens = max_step_tokens
    self.max_chunk = max_chunk
    self.max_waiting = max_waiting
    self.max_context = min(max_context or pool.max_seq_tokens, pool.max_seq_tokens)
    # Chunks per step (bounds the prefill rows bucket, hence the programs to warm up).
    self.max_prefill_chunks = max(1, min(max_prefill_chunks or max_slots, max_slots))
    self.prefix_cache = prefix_cache
    self.cache_generated = cache_generated
    if sessions is not None and (prefix_cache is None or sessions.cache is not prefix_cache):
      raise ValueError("sessions pin pages of the scheduler's own prefix cache")
    self.sessions = sessions
    self.sinks = sinks
    self.prefill_limit = prefill_limit
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
    self._loads: list[PageLoad] = []
    self._copies: list[PageCopy] = []
    self.prefix_copied_pages = 0  # reused prefix pages copied to another sub-pool

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
    elif need > self.max_context:
      reason = (f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.stop.max_tokens}) "
                f"exceeds the context ({self.max_context} tokens)")
    else:
      refusal = self.pool.can_ever_fit(need)
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
    s, z = req.sinks, self.pool.page_size
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
    refusal = self.pool.can_ever_fit(0, ring_entries(s.window, z))
    return refusal.message if refusal else None

  def cancel(self, request_id: str) -> None:
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
    if self.sessions is not None:
      self.sessions.expire()
    budget = self.max_step_tokens
    self._short = False  # a running sequence lacked pages this step (see _reserve)
    decode: list[DecodeRow] = []
    prefill: list[PrefillChunk] = []
    setups: list[SlotSetup] = []
    for seq in sorted(self._running, key=lambda s: s.key):
      if seq.state is not _State.RUNNING or not seq.decoding or budget < 1:
        continue
      if seq.generated + seq.inflight >= seq.req.stop.max_tokens:
        continue  # its last id is in flight; nothing more to compute
      if not self._reserve(seq, 1, preempt=True):
        continue
      decode.append(DecodeRow(seq.req.request_id, seq.slot, seq.computed))  # type: ignore[arg-type]
      seq.computed += 1
      seq.inflight += 1
      budget -= 1
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
    while (budget > 0 and self._waiting and self._free_slots and not self._short
           and len(prefill) < self.max_prefill_chunks):
      _, _, rid = self._waiting[0]
      seq = self._seqs[rid]
      if seq.inflight:  # preempted with an id still in flight: wait for it
        break
      hit = self._lookup(seq)
      if not self._allocate(seq, budget, hit):
        break  # no pages now: admit later (running sequences are never preempted for this)
      if self.prefix_cache is not None and seq.req.sinks is None:
        self.prefix_cache.record(hit)  # once per admission, however often it had to wait
      start = seq.computed
      if hit is not None and not seq.preemptions:
        seq.cached = start
      heapq.heappop(self._waiting)
      seq.slot = heapq.heappop(self._free_slots)
      seq.state = _State.RUNNING
      self._running.append(seq)
      setups.append(SlotSetup(seq.slot, rid, seq.req.sampling, seq.req.sinks))
      if seq.preemptions:
        seq.trace.record("resumed")
      if self.sessions is not None and seq.req.session_id and not seq.preemptions:
        paused_at = self.sessions.take(seq.req.session_id)  # its path is locked by seq now
        if paused_at is not None:
          seq.trace.record("paused", seq.req.session_id, t=paused_at)
          seq.trace.record("resume", f"{start} cached tokens")
      budget -= self._plan_chunk(seq, budget, prefill, reserved=True)
    self._step += 1
    seqs = [None] * self.max_slots
    for seq in self._running:
      seqs[seq.slot] = seq.req.request_id  # type: ignore[index]
    spills = forget = ()
    if self.prefix_cache is not None:
      spills = self.prefix_cache.take_spills()
      forget = tuple(self.prefix_cache.take_forgotten())
    loads, self._loads = tuple(self._loads), []
    copies, self._copies = tuple(self._copies), []
    return StepPlan(self._step, tuple(prefill), tuple(decode), tuple(setups),
                    self.pool.page_table(seqs), copies, spills=spills, forget=forget,
                    loads=loads)

  def _lookup(self, seq: _Seq) -> Match | None:
    cache = self.prefix_cache
    if cache is None or seq.req.sinks is not None:
      return None
    shard = cache.best_shard(seq.tokens)
    return None if shard is None else cache.match(seq.tokens, shard, count=False)

  def _allocate(self, seq: _Seq, budget: int, hit: Match | None) -> bool:
    """Pages for an admitted sequence's first chunk, starting on ``hit``'s pages (then
    ``seq.computed`` is the reused length); cached pages are reclaimed first. Returns False
    (nothing changed) when no sub-pool can hold it now."""
    rid, cache, pool = seq.req.request_id, self.prefix_cache, self.pool
    start = hit.tokens(pool.page_size) if hit is not None else 0
    total = start + min(budget, self.max_chunk, len(seq.tokens) - start)
    ring = seq.ring(pool.page_size)
    if hit is not None:
      shard = hit.shard
    else:  # the sub-pool with the most free or reclaimable pages
      usage = pool.usage()
      shard = max(range(len(usage)), key=lambda s: (self._room(s, usage), -s))
    prefix = hit.pages if hit is not None else ()
    if cache is not None:
      if hit is not None:
        cache.lock(hit)  # never evicted to make room for itself
      short = (ring or pool.pages_for(total)) - len(prefix) - pool.usage()[shard].free
      if short > 0:
        cache.evict(shard, short)
    refusal = pool.allocate(rid, total, shard, prefix=prefix, ring=ring)
    if refusal is None:
      seq.match = hit
      seq.computed = start
      if hit is not None and hit.host:  # host-tier pages come back onto its first new pages
        table = pool.table(rid)
        for node, page in zip(hit.host, table[len(prefix):]):
          self._loads.append(cache.promote(node, page))  # type: ignore[union-attr]
      return True
    if hit is not None:
      cache.unlock(hit)  # type: ignore[union-attr]
      if refusal.kind == "no_pages":  # its sub-pool is full: copy the prefix to another
        return self._allocate_copy(seq, budget, hit) or self._allocate(seq, budget, None)
    return False

  def _room(self, shard: int, usage) -> int:
    """Pages ``shard`` could give a new sequence now (``usage``: ``pool.usage()``): free, or
    cached and reclaimable (not the pages a session pins or a running sequence's match locks)."""
    free = usage[shard].free
    return free + (self.prefix_cache.reclaimable(shard) if self.prefix_cache is not None else 0)

  def _allocate_copy(self, seq: _Seq, budget: int, hit: Match) -> bool:
    """The sub-pool holding ``hit`` is full: start ``seq`` on the sub-pool with the most free
    pages, its first pages copies of the prefix's device pages (the plan's ``copies``, run
    before the step's writes; the source path stays locked while ``seq`` runs)."""
    if not hit.nodes:
      return False
    rid, pool, cache = seq.req.request_id, self.pool, self.prefix_cache
    usage = pool.usage()
    others = [s for s in range(len(usage)) if s != hit.shard]
    if not others:
      return False
    shard = max(others, key=lambda s: (self._room(s, usage), -s))
    device = Match(hit.shard, hit.nodes)  # a host part stays behind: recomputed
    start = device.tokens(pool.page_size)
    total = start + min(budget, self.max_chunk, len(seq.tokens) - start)
    cache.lock(device)  # type: ignore[union-attr]
    short = pool.pages_for(total) - usage[shard].free
    if short > 0:
      cache.evict(shard, short)  # type: ignore[union-attr]
    if pool.allocate(rid, total, shard) is not None:
      cache.unlock(device)  # type: ignore[union-attr]
      return False
    table = pool.table(rid)
    self._copies += [PageCopy(src, dst) for src, dst in zip(device.pages, table)]
    self.prefix_copied_pages += len(device.nodes)
    seq.match, seq.computed = device, start
    return True

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
    out.append(PrefillChunk(seq.req.request_id, seq.slot, tuple(seq.tokens[start:start + n]),  # type: ignore[arg-type]
                            start, sample))
    seq.computed += n
    if sample:
      seq.inflight += 1
      seq.decoding = True
    return n

  def _reserve(self, seq: _Seq, n: int, preempt: bool) -> bool:
    """Pages for ``n`` more positions of a running ``seq``. Decodes (``preempt``) may preempt
    sequences of lower priority, which the decode loop (in priority order) has not planned yet;
    with none left, ``seq`` itself yields. A prefill chunk may preempt a lower-priority sequence
    that is itself still in its prompt (none of those is planned yet: the prefill loop runs in
    priority order after the decodes); with none, it waits, keeping its pages. Without this, two
    long prompts admitted together could each hold half the pool and wait for the other forever.
    Any shortage stops admissions for the step (``_short``): a new request would take the pages
    a running one is waiting for, or that a preempted one was just made to give up."""
    while True:
      refusal = self.pool.extend(seq.req.request_id, n)
      if refusal is None:
        return True
      if refusal.kind != "no_pages":
        self._finish(seq, FinishReason.LENGTH, refusal.message)
        return False
      if self.prefix_cache is not None and self.prefix_cache.evict(
          self.pool.shard_of(seq.req.request_id), 1):
        continue  # a cached page was reclaimed: try again before preempting anyone
      self._short = True
      victim = self._victim(seq, prefilling_only=not preempt)
      if victim is None:
        if preempt:
          self._preempt(seq)
        return False
      self._preempt(victim)

  def _victim(self, seq: _Seq, prefilling_only: bool = False) -> _Seq | None:
    shard = self.pool.shard_of(seq.req.request_id)
    cands = [s for s in self._running if s.key > seq.key and s.req.sinks is None
             and self.pool.shard_of(s.req.request_id) == shard
             and not (prefilling_only and s.decoding)]
    return max(cands, key=lambda s: s.key, default=None)

  def _preempt(self, seq: _Seq) -> None:
    self._drop_running(seq)
    seq.state = _State.WAITING
    seq.computed = 0
    seq.decoding = False
    seq.preemptions += 1
    seq.trace.record("preempted")
    heapq.heappush(self._waiting, (seq.req.priority, seq.order, seq.req.request_id))

  def _drop_running(self, seq: _Seq) -> None:
    if seq.match is not None:
      self.prefix_cache.unlock(seq.match)  # type: ignore[union-attr]
      seq.match = None
    if seq.req.request_id in self.pool:
      self.pool.release(seq.req.request_id)
    if seq.slot is not None:
      heapq.heappush(self._free_slots, seq.slot)
      seq.slot = None
    if seq in self._running:
      self._running.remove(seq)

  # -- results ----------------------------------------------------------------------------------

  def update(self, result: StepResult) -> list[RequestOutput]:
    for rid, tok in result.tokens.items():
      seq = self._seqs.get(rid)
      if seq is None or seq.state is _State.DONE:
        continue
      seq.inflight -= 1
      seq.tokens.append(int(tok))
      seq.trace.record("first_token" if seq.generated == 1 else "token")
      if seq.generated == 1:  # the step that wrote the prompt has run: share its pages
        self._cache(seq, len(seq.req.prompt_ids))
      step = seq.checker.push(tok)
      ids = (int(tok),)
      lp = (result.logprobs[rid],) if rid in result.logprobs else ()
      if step.finish is not None:
        self._finish(seq, step.finish, "", ids, step.text, lp)
      else:
        self._outputs.append(RequestOutput(rid, ids, step.text, logprobs=lp))
    out, self._outputs = self._outputs, []
    return out

  def _cache(self, seq: _Seq, written: int) -> None:
    """Caches the whole pages of ``seq.tokens[:written]`` (positions whose KV a step planned
    earlier writes; only the prompt's when decode writes another pool)."""
    rid = seq.req.request_id
    if self.prefix_cache is None or rid not in self.pool or seq.req.sinks is not None:
      return
    if not self.cache_generated:
      written = min(written, len(seq.req.prompt_ids))
    written = min(written, seq.computed)
    self.prefix_cache.insert(seq.tokens[:written], self.pool.table(rid), self.pool.shard_of(rid))

  def _finish(self, seq: _Seq, reason: FinishReason, message: str,
              ids: tuple[int, ...] = (), text: str = "",
              lp: tuple[TokenLogprobs, ...] = ()) -> None:
    if reason is not FinishReason.ERROR and seq.state is _State.RUNNING:
      self._cache(seq, len(seq.tokens) - 1)  # the last id's KV is not written yet
      rid = seq.req.request_id
      if (self.sessions is not None and seq.req.session_id and rid in self.pool
          and seq.req.sinks is None):
        # The turn is paused: keep its KV pinned for the next one (matched on ids).
        self.sessions.pin(seq.req.session_id, self.prefix_cache.match(  # type: ignore[union-attr]
            seq.tokens, self.pool.shard_of(rid), count=False))
    self._drop_running(seq)
    if seq.state is _State.WAITING:
      self._waiting = [w for w in self._waiting if w[2] != seq.req.request_id]
      heapq.heapify(self._waiting)
    seq.state = _State.DONE
    seq.trace.record("finished", reason.value)
    del self._seqs[seq.req.request_id]
    self._outputs.append(RequestOutput(
        seq.req.request_id, ids, text, reason, message,
        Usage(len(seq.req.prompt_ids), seq.generated, seq.cached), lp))

  def _apply_cancellations(self) -> None:
    with self._cancel_lock:
      cancelled, self._cancelled = self._cancelled, []
    for rid in cancelled:
      seq = self._seqs.get(rid)
      if seq is not None:
        self._finish(seq, FinishReason.CANCELLED, "cancelled by the client")

  def fail(self, message: str, waiting: bool = False) -> list[RequestOutput]:
    """After an engine fault: see the module contract."""
    if self.prefix_cache is not None:
      self.prefix_cache.clear()  # pages a failed step was writing must not be reused
    if self.sessions is not None:
      self.sessions.clear()
    for seq in list(self._seqs.values()):
      seq.inflight = 0  # whatever was in flight is lost with the failed step
      if seq.state is _State.RUNNING or waiting:
        self._finish(seq, FinishReason.ERROR, message)
    return self.drain_outputs()

  def drain_outputs(self) -> list[RequestOutput]:
    """Outputs produced outside ``update`` (cancellations, length stops while planning)."""
    out, self._outputs = self._outputs, []
    return out


def run_to_completion(scheduler: Scheduler, execute: Callable[[StepPlan], StepResult | None],
                      max_steps: int = 1_000_000) -> list[RequestOutput]:
    """Drives plan -> execute -> update until idle (tests, offline runs). ``execute`` returns
    the result of the plan it was given (synchronous engines) or of an earlier one (``None``
    until one is ready)."""
    outs: list[RequestOutput] = []
    for _ in range(max_steps):
      outs += scheduler.drain_outputs()
      if scheduler.idle:
        return outs
      plan = scheduler.schedule()
      outs += scheduler.drain_outputs()
      result = execute(plan)
      if result is not None:
        outs += scheduler.update(result)
    raise RuntimeError(f"not idle after {max_steps} steps")


__all__ = ["PrefillChunk", "DecodeRow", "SlotSetup", "StepPlan", "StepResult", "Scheduler",
           "run_to_completion", "Refusal", "Sequence"]
