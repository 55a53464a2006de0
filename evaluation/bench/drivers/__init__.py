"""The ways a bench cell is run: in process (``inprocess``, with ``fedbuff`` and the dense fast path), through Flower's
simulation (``flower_sim``), or as a deployment on loopback (``deploy``), the last two from a federation on disk."""
