"""Triton kernels for the GPU executor (installed as ``chatapp.kernels``)."""
