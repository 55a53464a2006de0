"""The volunteer's side: its work on a task, its ClientApp and a test node's faults.

Uses the engine (``nodes.engine``, whose training function it runs) and the shared modules;
never the coordinator's side.
"""
