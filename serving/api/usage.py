"""Usage records: one JSON line per authenticated request, however it ended.

Contract: ``UsageLog(path)`` appends ``write(record)`` as one JSON line and flushes it before
returning (thread-safe); ``close()`` fsyncs. ``UsageLog(None)`` keeps nothing. The front end
writes exactly one record per request on the request's one end path (``serving.api.frontend``);
``records`` counts them. A record: ``request_id``, ``client_request_id``, ``api_key`` (the key's
name, never the key), ``slo_class``, ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``
(the request's, the prompt counted once however many samples: ``Stream.usage()``), ``n``,
``queue_s``, ``prefill_s``, ``ttft_s``, ``tpot_s``, ``e2e_s``, ``finish_reason`` (per sample),
``status`` (``ok``, ``invalid_argument``, ``rejected``, ``cancelled``, ``deadline_exceeded``,
``slow_consumer``, ``error``, ``unavailable``), ``message``, ``api`` (which front end:
``phaseserve``, ``jetstream``, ``openai``) and, when the client named one (OpenAI's ``user``),
``user``.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Mapping


class UsageLog:
  def __init__(self, path: str | None):
    self.path = path
    self._lock = threading.Lock()
    self._f = open(path, "a", encoding="utf-8") if path else None
    self.records = 0

  def write(self, record: Mapping[str, object]) -> None:
    line = json.dumps(record, sort_keys=True)
    with self._lock:
      self.records += 1
      if self._f is not None:
        self._f.write(line + "\n")
        self._f.flush()

  def close(self) -> None:
    with self._lock:
      if self._f is not None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
