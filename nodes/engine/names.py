"""Names in a round's record that the engine writes and torch-free readers look up (the
dashboard, served by the coordinator's supervisor, which never loads PyTorch)."""

TO_MEDIAN = "to-median"  # ||x_i - m||, what the flag policy's own ratio is taken from
