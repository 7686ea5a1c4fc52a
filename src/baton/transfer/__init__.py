"""Prefill/decode state handoff: the control channel, the plans and the data-plane backends.

``plan`` turns each state component's source and destination unit ids into coalesced byte
runs and one batch for all components; ``backends`` move those bytes; ``protocol`` is the
control channel's messages (handshake, destination ids, done/fail); the sender and receiver
compose them. This package file imports nothing: the router takes ``protocol.new_room`` and
must not load torch with the planner (it took the router from 60 to 250 MB).
"""
