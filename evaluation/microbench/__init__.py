"""Micro-benchmarks: aggregation speed in memory and out of core, peak memory, GPU against CPU, the spot
checks' tolerance."""
