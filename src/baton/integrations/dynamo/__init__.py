"""baton as an NVIDIA Dynamo backend: ``python -m baton.integrations.dynamo --role
colocated|prefill|decode [baton serve's flags] [--namespace ... --discovery-backend file]``.

A ``dynamo.common.backend.LLMEngine`` (Dynamo's unified Python backend, ai-dynamo 1.6.1,
``make dynamo``) over baton's engines; Dynamo's ``Worker`` registers it, serves its
``generate`` endpoint on Dynamo's request plane and hands it requests its frontend (or KV
router) picked. The roles are Dynamo's ``--disaggregation-mode``: ``colocated`` is ``agg``
(an ``AsyncEngine`` over ``LLMEngine``), ``prefill`` a ``PrefillServer`` whose control
endpoint (``--pd-host:--pd-port``) is the bootstrap address it registers, ``decode`` an
``AsyncEngine`` over a ``DecodeEngine``. baton's handshake is the bootstrap one Dynamo's
PrefillRouter drives: it draws a room and sends ``bootstrap_info`` (host, port, room) to
prefill and decode at once; the decode pairs with that prefill (a new address pairs on the
way, as a router-named prefill does) and asks it for the room's state; the prefill's own
``generate`` only answers the handoff payload (the decode drives it). A prefill asked
without ``bootstrap_info`` draws the room itself and answers it in ``disaggregated_params``
(Dynamo's synchronous path).

Each request's end says how its state came: ``engine_data.baton_handoff`` on the last chunk
(the ``x-baton-handoff`` value); a handoff that failed before the first token raises the
Dynamo error of its kind (``HANDOFF_ERRORS``) with that value in the message. Cancellation
(``abort``, or the stream closed) aborts the request in the engine and frees its units.
KV events (``colocated`` and ``prefill``, prefix caching on): baton's ``KVEventPublisher``
on a loopback port, which Dynamo's worker subscribes to (``ZmqSource``) and republishes to
its KV router. Options and outputs map as ``request`` says (the module Dynamo is not imported by,
tested everywhere); ``args`` is the command line, ``__main__`` the entry point.

The engine runs on its own thread (Dynamo's event loop owns the main one): prompt steps
through MKL are up to ~1.45x slower there than under ``baton serve`` (see
``AsyncEngine.run_here``); decode steps, on baton's kernels, are not.
"""
