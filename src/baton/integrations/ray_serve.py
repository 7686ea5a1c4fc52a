"""baton as a Ray Serve application: a prefill deployment and a decode deployment (the
OpenAI API), PD between their replicas. Needs ``ray[serve]`` (``make ray``; 2.60 tested).

``app(serve_args, prefill_options, decode_options)`` builds the application; ``serve.run``
it on a Ray cluster (``python -m baton.integrations.ray_serve`` does, from a node of it).
``serve_args`` are ``baton serve``'s flags for both roles (model, dtype, threads, backend,
...); the options are Serve's per deployment (``num_replicas``, ``autoscaling_config``,
``ray_actor_options`` -- e.g. ``{"resources": {"prefill": 0.01}}`` to keep prefills on the
nodes that declare that resource), passed through as given.

- ``BatonPrefill``: a ``PrefillServer`` whose control endpoint listens on the replica's node
  address (``--pd-host``, default that address; ``--pd-port``, default free) and a thread
  turning its loop. The endpoint is the replica's Serve metadata
  (``record_replica_metadata``); Serve's health check is the loop's health.
- ``BatonDecode``: baton's OpenAI app (``server.api.build_app``) over a ``DecodeEngine``,
  served by Serve's HTTP proxy. For each request it asks Serve's router for a prefill replica
  (``DeploymentHandle.choose_replica``: Serve's load balancing and health) and hands the
  decode that replica's endpoint as the request's route; the decode then pairs with it (a
  new endpoint pairs on the way) and pulls every state component, as under baton's router.
  With no replica to name within ``PICK_TIMEOUT_S`` (one restarting after a crash), the
  decode computes the prompt itself instead of holding the request for the restart.
  Routing headers must be signed with the PD token (``$BATON_PD_TOKEN``, the same in every
  replica), so a client cannot name a prefill through the proxy. Serve's health check is
  the engine thread's.

The PD token comes from the replicas' environment (``runtime_env={"env_vars": ...}`` or the
nodes'), never from ``serve_args``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from ray import serve
from ray.serve.handle import DeploymentHandle

from baton.cli_args import serve_parser

PICK_TIMEOUT_S = 1.0
"""How long a decode waits for Serve's router to name a prefill replica."""


def _args(role: str, serve_args: list[str]) -> argparse.Namespace:
    """``baton serve``'s flags in a replica: the role, and the node's address where a flag
    would bind loopback (the defaults serve one host; a replica's peers are on others)."""
    import ray

    args = serve_parser().parse_args([*serve_args, "--role", role])
    node = ray.util.get_node_ip_address()
    if args.pd_host == "127.0.0.1":
        args.pd_host = node
    if args.host == "127.0.0.1":
        args.host = node  # a decode's transfer engine advertises it
    return args


class BatonPrefill:
    """One prefill replica (the module docstring says how)."""

    def __init__(self, serve_args: list[str]) -> None:
        from baton.cli_serve import engine_options, prefill_server
        from baton.config import EngineConfig
        from baton.server.prefill_app import PrefillLoop

        args = _args("prefill", serve_args)
        server = prefill_server(args, EngineConfig.from_kwargs(**engine_options(args)))
        if server is None:
            raise RuntimeError(f"no PD token: set {args.token_env} in the replica's environment")
        self.loop = PrefillLoop(server).start()

    def record_replica_metadata(self) -> dict:
        return {"endpoint": self.loop.server.endpoint}

    def check_health(self) -> None:
        if not self.loop.is_alive:
            raise RuntimeError(f"the prefill loop stopped: {self.loop.error!r}")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


@serve.ingress()
class BatonDecode:
    """One decode replica behind Serve's HTTP proxy (the module docstring says how)."""

    def __init__(self, prefill: DeploymentHandle, serve_args: list[str]) -> None:
        from baton.cli_serve import decode_engine, engine_options
        from baton.config import EngineConfig, read_secret_env
        from baton.server.async_engine import AsyncEngine

        args = _args("decode", serve_args)
        decode = decode_engine(args, EngineConfig.from_kwargs(**engine_options(args)))
        if decode is None:
            raise RuntimeError("the decode engine did not start (the replica's log says why)")
        self.args, self.prefill = args, prefill
        self.token = read_secret_env(args.token_env).encode()
        self.engine = AsyncEngine(decode, keep_warm_s=decode.engine.config.keep_warm_s).start()

    async def pick_prefill(self) -> str | None:
        """The endpoint of the prefill replica Serve's router picks; None when it has none
        within ``PICK_TIMEOUT_S`` (a replica restarting: Serve would hold the request until
        one is up, ~10-17 s here), and the decode computes the prompt itself
        (``local_prefill; reason=no_healthy_prefill``)."""
        try:
            async with asyncio.timeout(PICK_TIMEOUT_S):
                async with self.prefill.choose_replica() as selection:
                    return selection.replica_metadata.get("endpoint")
        except TimeoutError:
            return None

    def __serve_build_asgi_app__(self):
        from baton.server.api import build_app

        args = self.args
        name = args.served_model_name or Path(args.model).name
        return build_app(
            self.engine,
            name,
            self.engine.engine.platform_info,
            int(args.max_body_mb * 2**20),
            self.token,
            pick_prefill=self.pick_prefill,
        )

    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise RuntimeError(f"the engine thread stopped: {self.engine.error!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            engine.engine.close()


def app(
    serve_args: list[str],
    prefill_options: dict | None = None,
    decode_options: dict | None = None,
):
    """The Serve application: ``BatonDecode`` (the ingress) bound to ``BatonPrefill``."""
    prefill = serve.deployment(BatonPrefill).options(**(prefill_options or {}))
    decode = serve.deployment(BatonDecode).options(**(decode_options or {}))
    return decode.bind(prefill.bind(serve_args), serve_args)


def main(argv: list[str] | None = None) -> None:
    """``python -m baton.integrations.ray_serve [--address A] [--http-port P]
    [--prefill-resource R] [--decode-resource R] -- [baton serve flags]``: deploy on the Ray
    cluster at ``--address`` and return (the application keeps running on the cluster)."""
    import json

    import ray

    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = _split(argv)
    p = argparse.ArgumentParser(prog="python -m baton.integrations.ray_serve")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto)")
    p.add_argument("--http-host", default="0.0.0.0")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--prefill-resource", help="a custom resource prefill replicas need")
    p.add_argument("--decode-resource", help="a custom resource decode replicas need")
    p.add_argument("--name", default="baton")
    args = p.parse_args(ours)
    serve_parser().parse_args(serve_args)  # bad flags here, not in a replica

    def options(replicas: int, resource: str | None) -> dict:
        actor = {"num_cpus": 0}
        if resource:
            actor["resources"] = {resource: 0.01}
        return {"num_replicas": replicas, "ray_actor_options": actor}

    ray.init(address=args.address, log_to_driver=False)
    serve.start(http_options={"host": args.http_host, "port": args.http_port})
    serve.run(
        app(
            serve_args,
            options(args.prefill_replicas, args.prefill_resource),
            options(args.decode_replicas, args.decode_resource),
        ),
        name=args.name,
        route_prefix="/",
    )
    print(json.dumps({"event": "deployed", "name": args.name, "port": args.http_port}))


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our flags, and ``baton serve``'s after ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


if __name__ == "__main__":
    main()
