"""API keys and per-key quotas.

Contract: ``ApiKeys.load(path)`` reads a JSON object ``{"<key>": {"name": "...",
"requests_per_min": N, "tokens_per_min": N, "admin": true}}`` (quotas optional, positive integers; a boolean,
which Python counts as an int, is refused: a ``ValueError`` naming the key's ``name`` and the
field, never the key itself); ``ApiKeys.none()`` accepts every caller as ``anonymous``.
``authenticate(key) -> KeyInfo`` raises ``Unauthenticated`` for a missing or unknown key (keys
compared by SHA-256 digest). ``admin``: the key may change what is served (the LoRA adapter
endpoints); only a key file grants it. ``Quotas.admit(info, tokens, now)`` raises ``OverQuota`` when the
key's sliding 60-second window already holds ``requests_per_min`` requests or the new request's
``tokens`` (prompt + n * max_tokens, what it may use) would pass ``tokens_per_min``; otherwise
it charges the window. ``settle(handle, tokens)`` corrects the charge to what the request really
used.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading


class Unauthenticated(Exception):
  pass


class OverQuota(Exception):
  pass


@dataclasses.dataclass(frozen=True)
class KeyInfo:
  name: str
  requests_per_min: int | None = None
  tokens_per_min: int | None = None
  admin: bool = False


def _digest(key: str) -> str:
  return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
  def __init__(self, keys: dict[str, KeyInfo] | None):
    self._by_digest = None if keys is None else {_digest(k): v for k, v in keys.items()}

  @classmethod
  def none(cls) -> "ApiKeys":
    return cls(None)

  @classmethod
  def load(cls, path: str) -> "ApiKeys":
    try:
      with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"--api_keys {path!r}: {e}") from None
    if not isinstance(obj, dict) or not obj:
      raise ValueError(f"--api_keys {path!r}: expected a non-empty JSON object key -> info")
    keys = {}
    for key, info in obj.items():
      if not isinstance(info, dict) or not isinstance(info.get("name"), str):
        raise ValueError(f"--api_keys {path!r}: each key needs {{\"name\": ...}}")
      extra = set(info) - {"name", "requests_per_min", "tokens_per_min", "admin"}
      if extra:
        raise ValueError(f"--api_keys {path!r}: unknown field {sorted(extra)[0]!r}")
      for q in ("requests_per_min", "tokens_per_min"):
        where = f"--api_keys {path!r}: key {info['name']!r}: {q}"
        if isinstance(info.get(q), bool):  # JSON true is no quota of 1
          raise ValueError(f"{where} must be a positive integer, not a boolean "
                           f"({json.dumps(info[q])})")
        if q in info and (not isinstance(info[q], int) or info[q] < 1):
          raise ValueError(f"{where} must be a positive integer")
      if not isinstance(info.get("admin", False), bool):
        raise ValueError(f"--api_keys {path!r}: key {info['name']!r}: admin must be a boolean")
      keys[key] = KeyInfo(info["name"], info.get("requests_per_min"), info.get("tokens_per_min"),
                          info.get("admin", False))
    return cls(keys)

  @property
  def enabled(self) -> bool:
    return self._by_digest is not None

  def authenticate(self, key: str | None) -> KeyInfo:
    if self._by_digest is None:
      return KeyInfo("anonymous")
    if not key:
      raise Unauthenticated("missing API key (metadata 'authorization: Bearer <key>')")
    info = self._by_digest.get(_digest(key))
    if info is None:
      raise Unauthenticated("unknown API key")
    return info


class Quotas:
  WINDOW_S = 60.0

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._windows: dict[str, collections.deque[list[float]]] = collections.defaultdict(
        collections.deque)

  def admit(self, info: KeyInfo, tokens: int, now: float) -> list[float] | None:
    if info.requests_per_min is None and info.tokens_per_min is None:
      return None
    with self._lock:
      win = self._windows[info.name]
      while win and win[0][0] <= now - self.WINDOW_S:
        win.popleft()
      if info.requests_per_min is not None and len(win) >= info.requests_per_min:
        raise OverQuota(f"API key {info.name!r} is over its quota of "
                        f"{info.requests_per_min} requests/min")
      used = sum(e[1] for e in win)
      if info.tokens_per_min is not None and used + tokens > info.tokens_per_min:
        raise OverQuota(f"API key {info.name!r} is over its quota of {info.tokens_per_min} "
                        f"tokens/min ({int(used)} used in the last minute, this request may "
                        f"use {tokens})")
      entry = [now, float(tokens)]
      win.append(entry)
      return entry

  def settle(self, entry: list[float] | None, tokens: int) -> None:
    if entry is not None:
      with self._lock:
        entry[1] = float(tokens)
