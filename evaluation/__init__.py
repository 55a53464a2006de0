"""The benchmark harness, in sub-packages by role (DESIGN, "Layout"):

- ``bench``: ``robust bench`` (a scenario grid of cells: attacks against defences), what a cell
  is, the threat model, Ray dispatch; ``bench.drivers``: the ways a cell is run on the serve loop
  (in process, Flower's simulation, a deployment on loopback);
- ``simtime``: simulated time (the volunteers' traits, arrivals, a cell's timeline, the serve
  loop's simulated clock);
- ``reports``: ``summary.md``/``summary.html``, its sections, tables, plots and metrics;
- ``microbench``: ``robust agg-bench`` (in memory and out of core), peak memory, GPU against CPU,
  the spot checks' tolerance;
- ``peers``: the baselines the bench is measured against (Flower's and ByzFL's rules,
  Flower's FedAvg, a per-node loop, a hand-vectorised loop);
- ``field``: a real deployment under load (``robust stress``, light nodes, ``robust
  deploy-bench``, a large model's and the SuperLink's memory).

The measurement commands keep their names: ``python -m evaluation.hand_loop``,
``evaluation.large_model``, ``evaluation.spot_tolerance``, ``evaluation.device_speed`` and
``evaluation.flower_memory`` are thin entry modules here that call their sub-package's ``main``.
"""
