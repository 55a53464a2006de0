"""Baselines and peers the bench is measured against: Flower's and ByzFL's robust aggregators,
Flower's FedAvg, a per-node training loop, a hand-vectorised loop."""
