"""The Dynamo worker's command line (imports nothing of Dynamo's: ``__main__`` parses it and
sets Dynamo's environment before Dynamo's runtime loads and reads it)."""

from __future__ import annotations

import argparse

from baton.cli_args import serve_parser

ADVERTISED = ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST")
"""The variables Dynamo reads for the address a process advertises on each plane."""


def build_parser() -> argparse.ArgumentParser:
    """``baton serve``'s flags (``--host``/``--port`` unused: Dynamo's request plane serves)
    and Dynamo's worker flags."""
    parser = serve_parser()
    parser.prog = "python -m baton.integrations.dynamo"
    parser.description = "baton as an NVIDIA Dynamo backend worker"
    dyn = parser.add_argument_group("Dynamo")
    dyn.add_argument("--namespace", default="dynamo")
    dyn.add_argument("--component", default=None, help="default: baton, or baton-prefill")
    dyn.add_argument("--endpoint", default="generate")
    dyn.add_argument("--discovery-backend", default="etcd", help="etcd, file, kubernetes, mem")
    dyn.add_argument("--request-plane", default="tcp")
    dyn.add_argument("--event-plane", default=None, help="zmq or nats (Dynamo's default)")
    dyn.add_argument(
        "--advertise-host",
        default=None,
        help="the address other hosts reach this worker's Dynamo planes at (sets "
        + ", ".join(ADVERTISED)
        + "); default: Dynamo's choice, the machine's first interface",
    )
    dyn.add_argument(
        "--disable-kv-routing",
        action="store_true",
        help="publish no KV events or load metrics to Dynamo's router",
    )
    return parser
