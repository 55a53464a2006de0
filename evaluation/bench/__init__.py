"""``robust bench``: a scenario grid of cells, what a cell is, its threat model, and where cells run."""
