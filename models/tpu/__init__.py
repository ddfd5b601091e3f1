"""The TPU kernels' adapters (JAX's Pallas TPU kernels run on TPU; off it, their reference functions)."""
