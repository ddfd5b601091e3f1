"""The XLA flags of the CLIs and servers the tests start (``XLA_FLAGS=CLI_XLA_FLAGS`` in their
environment): their own, not the suite's 8 fake devices, with LLVM at optimization level 0 as
the suite's own programs (conftest.py). XLA's HLO passes, hence the numerics, are the product's;
the tiny models' many programs are compile-bound (tests/launch/test_serve_offline.py: 51 -> 31 s
on the Xeon, measured)."""

CLI_XLA_FLAGS = "--xla_backend_optimization_level=0"
