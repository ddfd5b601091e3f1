"""The import contracts of pyproject.toml's [tool.importlinter] hold (`lint-imports`): data flows one
way, launch -> serving.api -> serving -> partitioning -> models; the engine core never imports the
wire; the product never imports launch.lab; models.cpu / io / text never import the layers above."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO


def _lint_imports() -> str:
  here = Path(sys.executable).parent / "lint-imports"
  found = str(here) if here.exists() else shutil.which("lint-imports")
  assert found, "lint-imports not installed: pip install -e '.[test]'"
  return found


def test_import_contracts_are_kept():
  run = subprocess.run([_lint_imports(), "--no-cache"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
  out = run.stdout + run.stderr
  assert run.returncode == 0, f"import contracts broken (pyproject.toml [tool.importlinter]):\n{out}"
  assert "0 broken" in out, out
