"""A JSON file of measured results keyed by a string (the layout and CPU-lowering autotunes).

Contract: ``load(path)`` is the file's object, or ``{}`` when it is missing, unreadable or not an
object; ``store(path, key, entry)`` rewrites the file with ``key`` set, atomically (a temporary
file renamed over it), so concurrent readers see the old or the new file, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile


def load(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    return data if isinstance(data, dict) else {}
  except (OSError, json.JSONDecodeError):
    return {}


def store(path: str, key: str, entry: object) -> None:
  directory = os.path.dirname(path) or "."
  os.makedirs(directory, exist_ok=True)
  data = load(path)
  data[key] = entry
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
  with os.fdopen(fd, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
