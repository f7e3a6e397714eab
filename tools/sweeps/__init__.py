"""Sweeps: launch settings over many shapes on the GPU (prefill V-slices, decode slices and warps), the cost of
prefix-cache checkpoints, and the exactness matrix (bitwise equality across plans, accuracy against float64)."""
