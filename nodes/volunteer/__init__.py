"""The volunteer's side: its work on a task (``volunteer``), the answer to a task and the
in-process ClientApp (``client_app``), the warm trainer that gives that answer in a deployment
(``trainer``), the thin ClientApp that hands it each task (``thin_app``) over the node's local
channel (``channel``), ``robust node join``'s supervisor (``join``), the node's log of what it
sent (``worklog``) and a test node's faults (``faults``).

Uses the engine (``nodes.engine``, whose training function it runs) and the shared modules;
never the coordinator's side.
"""
