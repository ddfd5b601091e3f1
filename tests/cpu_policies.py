"""What the native-kernel tests share: the skip marker for CPUs without the kernels, and CPU
backends (``models.cpu.backend.CpuBackend``) with every native path on (the ``DEFAULT`` policy:
up to 16 rows) or the native matmuls off, whatever this machine would measure."""

import dataclasses

import pytest

from models.cpu import backend as cpu_backend, kernels as cpu_kernels, lowering as cpu_lowering

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="native CPU kernels unavailable here (CPU / compiler)")
NATIVE = cpu_backend.native(cpu_lowering.DEFAULT)
XLA_ONLY = dataclasses.replace(NATIVE, amx=False, dpbf16=False, policy=dataclasses.replace(
    cpu_lowering.DEFAULT, float_native_max_rows=0, f32_native_max_rows=0, int8_native_max_rows=0,
    int8_nk_native_max_rows=0))
