"""Torch reference kernels (Triton versions used on CUDA)."""
