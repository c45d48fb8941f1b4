"""Triton kernels for the tree path on CUDA, each beside a pure-torch reference."""
