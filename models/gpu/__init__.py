"""Kernels for GPU backends (Pallas, Triton lowering), tested on CPU in Pallas's interpreter."""
