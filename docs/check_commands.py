"""Checks that every ``python -m MODULE`` named in README.md, BUILD_NOTES.md and docs/*.md imports.

Run from the repository root: ``.venv/bin/python docs/check_commands.py``; exit 1 lists each
command whose module is not found (the module itself is not imported, only located). The
issue-28 plan is for a test to call ``missing()``.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_MODULE_RE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_EXTERNAL = {"pytest", "pip", "grpc_tools", "venv", "http", "vllm", "llama_cpp", "json"}


def documents() -> list[pathlib.Path]:
  return [_ROOT / "README.md", _ROOT / "BUILD_NOTES.md", *sorted((_ROOT / "docs").glob("*.md"))]


def missing() -> list[tuple[str, str]]:
  """(file, module) for each ``python -m`` module that cannot be found."""
  sys.path.insert(0, str(_ROOT))
  out = []
  for path in documents():
    for module in sorted(set(_MODULE_RE.findall(path.read_text()))):
      module = module.rstrip(".")
      if module.split(".")[0] in _EXTERNAL:
        continue
      try:
        found = importlib.util.find_spec(module) is not None
      except ModuleNotFoundError:
        found = False
      if not found:
        out.append((path.name, module))
  return out


if __name__ == "__main__":
  bad = missing()
  for name, module in bad:
    print(f"{name}: python -m {module}: not found")
  sys.exit(1 if bad else 0)
