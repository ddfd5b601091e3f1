"""Shared plumbing of the ``launch`` CLIs: user errors are one line on stderr and exit code 2.

Contract: a CLI raises ``CliError`` for bad input and calls ``run(main)`` under ``__main__``;
bad flags (unknown flag, value out of range) and ``CliError`` both exit 2 with ``error: ...``.
``start(argv, required=())`` is a script's first line in ``main``: warnings-only logging, no
positional arguments, the named flags set. ``positive_ints(name, values)`` parses a list flag;
``preset(value)`` checks a ``--model`` that must be a preset the CLI can instantiate.
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


def start(argv: list[str], required: tuple[str, ...] = ()) -> None:
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise CliError(f"unexpected arguments: {' '.join(argv[1:])}")
  for name in required:
    if not flags.FLAGS[name].value:
      raise CliError(f"--{name} is required")


def positive_ints(name: str, values: list[str]) -> tuple[int, ...]:
  try:
    out = tuple(int(v) for v in values)
  except ValueError:
    raise CliError(f"--{name} must be integers, got {','.join(values)!r}") from None
  if not out or min(out) < 1:
    raise CliError(f"--{name} must be positive integers, got {','.join(values)!r}")
  return out


def preset(value: str) -> str:
  """``value`` if it names a preset this process can build (not the paper's PaLM shapes)."""
  from models.config import PRESET_NAMES
  if value not in PRESET_NAMES or value.startswith("palm"):
    raise CliError(f"--model must be an instantiable preset, got {value!r}")
  return value


def run(main: Callable[[list[str]], None]) -> None:
  try:
    app.run(main, flags_parser=parse_flags)
  except CliError as e:
    fail(str(e))
