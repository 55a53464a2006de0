"""Load and field tools: a real deployment on loopback under load (``robust stress``, light nodes), its round
overhead beside Flower's FedAvg (``robust deploy-bench``), a large model's and the SuperLink's memory."""
