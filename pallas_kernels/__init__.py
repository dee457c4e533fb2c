"""Pallas GPU kernels for NSA (Triton-lowered and Mosaic GPU), each with a custom VJP."""
