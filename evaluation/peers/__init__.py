"""Baselines and peers the bench is measured against: Flower's robust aggregators and FedAvg, a per-node
training loop, a hand-vectorised loop."""
