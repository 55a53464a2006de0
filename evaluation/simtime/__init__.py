"""Simulated time in the bench: the volunteers' traits, when their replies arrive, a cell's timeline, and the
simulated clock the coordinator's serve loop is given (beside the product's ``nodes.engine.clocks``)."""
