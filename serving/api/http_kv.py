"""Prefill and decode in separate servers over HTTP: the KV handoff of a request's prompt.

The protocol is vLLM's as the SGLang Model Gateway drives it for vLLM workers (its
``--pd-disaggregation`` mode): the gateway sends the request to the prefill server with
``max_tokens`` 1, takes the ``kv_transfer_params`` object of that response and sends the request
to the decode server with it; the decode server pulls the prompt's KV pages from the prefill
server, then decodes. Here the object is ``{"phaseserve": {"url": <the prefill server's HTTP
base>, "prompt_token_ids": [...]}}``.

Contract:
  * ``handoff(url, prompt_ids) -> dict``: the ``kv_transfer_params`` a prefill server adds to a
    response (``HttpOptions.kv_role == "prefill"``).
  * ``export(loop, body) -> bytes | None``: ``POST /v1/kv/pages`` on a prefill server, body
    ``{"prompt_token_ids": [...]}``: the pages its prefix cache holds for the longest prefix, as
    ``serving.kv_transfer.KvPages`` bytes (None: none held); ``ValueError`` for a bad body.
  * ``HttpKvSource(timeout_s)``: the ``KvSource`` over that route (the route takes the server's
    API keys, as every other; the decode server presents the client's ``Authorization``).
    ``pull(loop, source, body, credential)`` (a decode server, before admission): when ``body``
    carries the handoff, fetches the pages and adopts them into the loop's prefix cache; returns
    the tokens adopted. Any failure (the
    prefill server gone, a layout that differs) is logged and adopts nothing: the decode server
    then computes the prompt itself, so the answer is the same, only slower.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any, Mapping, Sequence

from serving.kv_transfer import KvPages, KvSource, export_prefix, import_prefix
from serving.loop import ServingLoop

_log = logging.getLogger(__name__)
KEY = "phaseserve"


def handoff(url: str, prompt_ids: Sequence[int]) -> dict:
  return {KEY: {"url": url, "prompt_token_ids": [int(t) for t in prompt_ids]}}


def _ids(obj: Any) -> list[int]:
  ids = obj.get("prompt_token_ids") if isinstance(obj, Mapping) else None
  if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
    raise ValueError("prompt_token_ids: a list of token ids is required")
  return ids


def export(loop: ServingLoop, body: Any) -> bytes | None:
  pages = export_prefix(loop, _ids(body))
  return None if pages is None else pages.to_bytes()


class HttpKvSource(KvSource):
  def __init__(self, timeout_s: float = 30.0):
    self.timeout_s = timeout_s

  def fetch(self, params: Mapping[str, object], tokens: Sequence[int],
            credential: str = "") -> KvPages | None:
    url = str(params["url"]).rstrip("/") + "/v1/kv/pages"
    headers = {"content-type": "application/json"}
    if credential:
      headers["Authorization"] = credential
    req = urllib.request.Request(url, json.dumps({"prompt_token_ids": list(tokens)}).encode(),
                                 headers)
    try:
      with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
        return KvPages.from_bytes(r.read())
    except urllib.error.HTTPError as e:
      if e.code == 404:  # the prefill server holds none of it (evicted, or never computed)
        return None
      raise


def pull(loop: ServingLoop, source: KvSource, body: Any, credential: str = "") -> int:
  params = body.get("kv_transfer_params") if isinstance(body, Mapping) else None
  mine = params.get(KEY) if isinstance(params, Mapping) else None
  if not isinstance(mine, Mapping):
    return 0
  try:
    pages = source.fetch(mine, _ids(mine), credential)
    return 0 if pages is None else import_prefix(loop, pages)
  except Exception as e:  # the decode server computes the prompt itself
    _log.warning("KV handoff from %s failed (%s: %s); computing the prompt here",
                 mine.get("url"), type(e).__name__, e)
    return 0
