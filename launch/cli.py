"""Shared plumbing of the ``launch`` CLIs: user errors are one line on stderr and exit code 2.

Contract: a CLI raises ``CliError`` for bad input and calls ``run(main)`` under ``__main__``;
bad flags (unknown flag, value out of range) and ``CliError`` both exit 2 with ``error: ...``.
"""

from __future__ import annotations

import sys
from typing import Callable, NoReturn

from absl import app, flags


class CliError(Exception):
  """A user error: printed as one line, exit code 2."""


def fail(message: str) -> NoReturn:
  print(f"error: {message}".replace("\n", " "), file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def run(main: Callable[[list[str]], None]) -> None:
  try:
    app.run(main, flags_parser=parse_flags)
  except CliError as e:
    fail(str(e))
