"""The product packages type-check: mypy with pyproject.toml's [tool.mypy] (models, partitioning,
serving, launch; not launch/lab nor the generated gRPC modules). Its cache lives in .cache/mypy, so
a re-run checks only the files that changed. Every ``# type: ignore[code]`` there says why, in a
comment after it or on the line above."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.paths import REPO

PACKAGES = ("models", "partitioning", "serving", "launch")
IGNORE = re.compile(r"#\s*type:\s*ignore(\[[\w, -]+\])?(.*)$")


def test_product_packages_type_check():
  run = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(REPO / ".cache" / "mypy")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  out = run.stdout + run.stderr
  assert run.returncode == 0, f"mypy (pyproject.toml [tool.mypy]) found errors:\n{out}"


def _product_files():
  for package in PACKAGES:
    for path in sorted((REPO / package).rglob("*.py")):
      rel = path.relative_to(REPO).as_posix()
      if not rel.startswith("launch/lab/") and "_pb2" not in path.name:
        yield rel, path.read_text().splitlines()


def test_every_type_ignore_has_a_code_and_a_reason():
  bare = []
  for rel, lines in _product_files():
    for n, line in enumerate(lines, 1):
      m = IGNORE.search(line)
      if m is None:
        continue
      reason_after = m.group(2).strip().lstrip("#").strip()
      reason_above = n > 1 and lines[n - 2].strip().startswith("#")
      if not m.group(1) or not (reason_after or reason_above):
        bare.append(f"{rel}:{n}: {line.strip()}")
  assert not bare, (f"{len(bare)} `# type: ignore` without [code] and reason:\n" + "\n".join(bare))
