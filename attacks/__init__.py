"""Byzantine behaviours: omniscient attacks on the round's updates and node-side attacks."""
