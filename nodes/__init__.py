"""The coordinator (ServerApp and round logic), the volunteer (ClientApp) and their launchers.

By role, imports pointing one way (``tests/test_layout.py`` checks it):

- ``nodes.engine``: the one round engine and the one training protocol, which every side
  and every driver runs;
- ``nodes.coordinator``: the coordinator's side (its state, ServerApp, admission, audit,
  spot-check referee, status);
- ``nodes.volunteer``: the volunteer's side (its work, ClientApp, test faults).

Both sides use the engine and the shared modules here (``wire``, ``checkpoint``,
``settings``, ``codetrust``, ``launch``), never each other. ``strategy`` (the Flower
strategy) uses the engine only; ``cli``, ``commands`` and ``demo`` dispatch to both sides.
"""
