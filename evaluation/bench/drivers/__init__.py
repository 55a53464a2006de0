"""The ways a bench cell is run, all on the product's serve loop (``nodes.engine.serve``): in process
(``inprocess``: its transport and desk in ``serving``, the dense fast path in ``batched_dense``),
through Flower's simulation (``flower_sim``), or as a deployment on loopback (``deploy``), the last
two from a federation on disk."""
