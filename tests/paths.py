"""Where the repository and the tests' data live, for tests at any depth."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
