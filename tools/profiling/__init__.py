"""Profiling: what the compiler made of each kernel (registers, SASS, per source line, on any machine) and where
the device spends its time (per-kernel times, host overhead, decode's latency floor, Nsight Compute)."""
