"""Benchmarks: aggregation speed (``robust agg-bench``) and, later, attacks against defences."""
