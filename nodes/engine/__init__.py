"""The round engine and the one training protocol: what every driver and both sides run.

Inside ``nodes``, it imports only its own modules and the shared ``nodes.wire`` and
``nodes.checkpoint``: never the coordinator's or the volunteer's side.
"""
