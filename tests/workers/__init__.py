"""Programs the multi-process tests run as ``python -m tests.workers.<name>`` (see tests/multiproc.py)."""
