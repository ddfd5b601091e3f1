"""The project's English passages and the ``===`` split every quality tool reads them with.

Contract: ``DEFAULT_PASSAGES`` is ``tests/data/english_passages.txt`` (written for this project);
``read_passages(path)`` splits a UTF-8 file into passages at lines holding only ``===``
(stripped, empty ones dropped). No JAX here: the launchers that only send text import it.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_PASSAGES = Path(__file__).resolve().parents[2] / "tests" / "data" / "english_passages.txt"


def read_passages(path: str | Path) -> list[str]:
  text = Path(path).read_text(encoding="utf-8")
  parts: list[str] = []
  current: list[str] = []
  for line in text.splitlines():
    if line.strip() == "===":
      parts.append("\n".join(current).strip())
      current = []
    else:
      current.append(line)
  parts.append("\n".join(current).strip())
  return [p for p in parts if p]
