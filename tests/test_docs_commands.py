"""The commands the docs give still name real things: every ``python -m <module>`` in README.md,
BUILD_NOTES.md, docs/*.md (not the archive), the Makefile and launch's shell scripts can be found
(``find_spec``, never run), and every ``launch/...`` / ``tests/...`` script they name exists.
Commands run by another interpreter (the reference, JetStream or vLLM venvs, Python 3.11) are not
this venv's to check."""

from __future__ import annotations

import importlib.util
import re

from tests.paths import REPO

ARCHIVE = "docs/build_notes_archive.md"
# An interpreter, then -m and a dotted name: python, python3.12, .venv/bin/python, $(PY), $(REF_PY).
MODULE = re.compile(r"(\S*python[\d.]*|\$\((?:[A-Z_]*_)?PY(?:THON\d*)?\))\s+-m\s+([A-Za-z_][\w.]*)")
OTHER_PYTHONS = re.compile(r"venv-|REF_PY|JS_PY|PYTHON311|python3\.11")
PATH = re.compile(r"(?<![\w/.-])((?:launch|tests)/[\w/.-]*\.(?:py|sh))\b")


def _docs() -> list[str]:
  names = ["README.md", "BUILD_NOTES.md", "Makefile"]
  names += sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
  names += sorted(p.relative_to(REPO).as_posix() for p in (REPO / "launch").rglob("*.sh"))
  return [n for n in names if n != ARCHIVE and (REPO / n).is_file()]


def _findable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a missing parent package
    return False


def test_docs_name_modules_and_scripts_that_exist():
  misses = []
  for name in _docs():
    for n, line in enumerate((REPO / name).read_text().splitlines(), 1):
      for m in MODULE.finditer(line):
        module = m.group(2).rstrip(".")
        if not OTHER_PYTHONS.search(m.group(1)) and not _findable(module):
          misses.append(f"{name}:{n}: python -m {module}: no such module")
      for m in PATH.finditer(line):
        if not (REPO / m.group(1)).exists():
          misses.append(f"{name}:{n}: {m.group(1)}: no such file")
  assert not misses, f"{len(misses)} stale command(s) in the docs:\n" + "\n".join(misses)


def test_the_scan_finds_commands():
  """The patterns still match the docs' style (a silent scan would pass everything)."""
  def module(text):
    return MODULE.search(text).group(2)
  assert module("make run: $(PY) -m launch.demo --model smollm2-135m") == "launch.demo"
  assert module("`.venv/bin/python -m launch.lab.plan --chips 8`") == "launch.lab.plan"
  assert module("$(PYTEST) -m slow; python3 -m venv .venv") == "venv"
  assert OTHER_PYTHONS.search(MODULE.search("$(REF_PY) -m pip install").group(1))
  path = PATH.search("run `tests/e2e/test_multihost.py::test_x`")
  assert path.group(1) == "tests/e2e/test_multihost.py"
  assert "README.md" in _docs()
  readme = (REPO / "README.md").read_text()
  assert MODULE.search(readme), "README.md names no `python -m` command: has the pattern drifted?"
