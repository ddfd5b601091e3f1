"""The open-loop run: every session starts at its scheduled arrival, whatever is still in flight.

Contract: ``await run_open_loop(workload, driver, slo, progress, run_tag)`` returns a ``RunResult``:
one ``RequestRecord`` per turn sent, in completion order, the wall time (the first scheduled
arrival to the last end), the largest lateness of a send (scheduled vs actual: how far this
client fell behind its own schedule) and the turns never sent (a session stops at its first
failed turn). Each session is its own task created before the run, sleeping until its arrival:
no send waits for another request's answer (only a session's next turn waits for its previous
one, then ``pause_s``). Client-side latencies (seconds, this machine's monotonic clock): TTFT =
first token - send; TPOT = (end - first token) / (output tokens - 1), first token excluded,
``None`` below 2 tokens; e2e = end - send. Session ids sent are ``<run_tag>-<session>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from launch.lab.loadgen_lib.drivers import Driver, Outcome
from launch.lab.loadgen_lib.slo import Slo
from launch.lab.loadgen_lib.workload import Workload, ids_to_text


@dataclasses.dataclass(frozen=True)
class RequestRecord:
  session: int
  turn: int
  scheduled_s: float      # from the run's start
  send_lag_s: float       # actual send - scheduled send
  status: str
  error: str
  prompt_len: int         # ids this client built (text APIs: words)
  prompt_tokens: int | None  # as the server counted them
  cached_tokens: int | None
  max_tokens: int
  output_tokens: int
  finish_reason: str
  ttft_s: float | None
  tpot_s: float | None
  e2e_s: float
  queue_s: float | None
  prefill_s: float | None
  server_ttft_s: float | None
  server_tpot_s: float | None
  server_e2e_s: float | None
  meets_slo: bool


COLUMNS = tuple(f.name for f in dataclasses.fields(RequestRecord))


@dataclasses.dataclass(frozen=True)
class RunResult:
  records: tuple[RequestRecord, ...]
  wall_s: float
  max_send_lag_s: float
  turns_not_sent: int


def _record(session: int, turn: int, scheduled_s: float, due: float, prompt_len: int,
            max_tokens: int, o: Outcome, slo: Slo) -> RequestRecord:
  ok = o.status == "ok"
  ttft = o.first_s - o.sent_s if ok and o.first_s is not None else None
  tpot = ((o.end_s - o.first_s) / (o.output_tokens - 1)
          if ttft is not None and o.output_tokens > 1 else None)
  return RequestRecord(session, turn, scheduled_s, max(0.0, o.sent_s - due), o.status, o.error,
                       prompt_len, o.prompt_tokens, o.cached_tokens, max_tokens, o.output_tokens,
                       o.finish_reason, ttft, tpot, o.end_s - o.sent_s, o.queue_s, o.prefill_s,
                       o.server_ttft_s, o.server_tpot_s, o.server_e2e_s,
                       ok and slo.met(ttft, tpot))


async def run_open_loop(workload: Workload, driver: Driver, slo: Slo, progress: bool = True,
                        run_tag: str = "run") -> RunResult:
  from tqdm import tqdm
  records: list[RequestRecord] = []
  not_sent = [0]
  last_end = [0.0]
  bar = tqdm(total=workload.requests, unit="req", disable=not progress, leave=False,
             dynamic_ncols=True)
  t0 = time.monotonic() + 0.05  # every task exists before the first arrival

  async def session(spec) -> None:
    await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.monotonic()))
    ids: tuple[int, ...] = ()
    text = ""
    sid = f"{run_tag}-{spec.session_id}" if spec.session_id else ""
    due = t0 + spec.arrival_s
    for k, turn in enumerate(spec.turns):
      if k:
        await asyncio.sleep(turn.pause_s)
        due = time.monotonic()
      ids += turn.new_ids
      text += ids_to_text(turn.new_ids)
      o = await driver.generate(ids, text, turn.max_tokens, sid)
      records.append(_record(spec.index, k, due - t0, due, len(ids), turn.max_tokens, o, slo))
      last_end[0] = max(last_end[0], o.end_s)
      bar.update(1)
      if o.status != "ok":
        not_sent[0] += len(spec.turns) - k - 1
        bar.update(len(spec.turns) - k - 1)
        return
      ids += o.output_ids
      text += o.output_text

  tasks = [asyncio.create_task(session(s)) for s in workload.sessions]
  try:
    await asyncio.gather(*tasks)
  finally:
    bar.close()
  wall = max(1e-9, last_end[0] - (t0 + min((s.arrival_s for s in workload.sessions),
                                            default=0.0)))
  lag = max((r.send_lag_s for r in records), default=0.0)
  return RunResult(tuple(records), wall, lag, not_sent[0])
