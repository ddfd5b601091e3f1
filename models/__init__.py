"""phaseserve models: what a decoder-only transformer computes, as pure functions over pytrees.

Models name logical axes only (``embed``, ``heads``, ...); they never see a mesh.
"""
