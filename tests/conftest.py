"""Test set-up: 8 fake CPU devices, set before jax is first imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# CPU unless asked to test the accelerator (launch/device_check.sh sets PHASESERVE_TEST_ACCELERATOR=1).
if os.environ.get("PHASESERVE_TEST_ACCELERATOR") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A fixed CPU lowering policy (models.cpu_lowering.DEFAULT) for every test and the CLIs they start:
# deterministic, and no start-up measurement on a loaded CI machine; tests/test_cpu_lowering.py
# exercises the measurement itself.
os.environ.setdefault("PHASESERVE_CPU_AUTOTUNE", "0")
