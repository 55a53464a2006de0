"""The coordinator's side: its state and round loop, the ServerApp, admission, attendance,
the audit log, the spot-check referee and the status view.

Uses the engine (``nodes.engine``) and the shared modules; never the volunteer's side.
"""
