"""The import contracts of pyproject.toml's [tool.importlinter] hold (`lint-imports`): data flows one
way, launch -> serving.api -> serving -> partitioning -> models; the engine core never imports the
wire; the product never imports launch.lab; models.cpu / io / text never import the layers above."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO


# import-linter's console script, run by this interpreter (a script's shebang can name a moved venv).
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_import_contracts_are_kept():
  run = subprocess.run([sys.executable, "-c", _LINT, "--no-cache"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
  out = run.stdout + run.stderr
  assert run.returncode == 0, f"import contracts broken (pyproject.toml [tool.importlinter]):\n{out}"
  assert "0 broken" in out, out
