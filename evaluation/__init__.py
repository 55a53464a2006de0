"""The benchmark harness: ``robust bench`` (attacks against defences on scenario grids: the
engine, detectors, metrics, report and plots) and ``robust agg-bench`` (aggregation speed)."""
