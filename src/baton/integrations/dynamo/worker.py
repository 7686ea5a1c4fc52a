"""``BatonLLMEngine``: baton's engines behind Dynamo's ``Worker`` (the package docstring says
how); imports Dynamo (``make dynamo``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from dynamo.common.backend.engine import EngineConfig, LLMEngine, LlmRegistration
from dynamo.common.backend.publisher import ZmqSource
from dynamo.common.backend.worker import WorkerConfig
from dynamo.common.constants import DisaggregationMode
from dynamo.llm import exceptions as dynamo_errors

from baton.engine.outputs import HandoffReason
from baton.integrations.dynamo import request as dr
from baton.integrations.dynamo.args import build_parser
from baton.sampling_params import InvalidRequest

logger = logging.getLogger("baton.dynamo")

MODES = {
    "colocated": DisaggregationMode.AGGREGATED,
    "prefill": DisaggregationMode.PREFILL,
    "decode": DisaggregationMode.DECODE,
}
"""baton's ``--role`` -> Dynamo's disaggregation mode."""

HANDOFF_ERRORS = {
    HandoffReason.PREFILL_UNREACHABLE: dynamo_errors.Disconnected,
    HandoffReason.STATE_TIMEOUT: dynamo_errors.ConnectionTimeout,
    HandoffReason.ABORTED: dynamo_errors.Cancelled,
    HandoffReason.NO_ROOM: dynamo_errors.InvalidArgument,
}
"""A failed handoff's reason -> the Dynamo error it raises (others: ``Unknown``)."""


class BatonLLMEngine(LLMEngine):
    """baton behind Dynamo's ``Worker`` (the module docstring says how)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = MODES[args.role]
        self.engine: Any = None
        """The ``AsyncEngine`` (colocated, decode)."""
        self.prefill: Any = None
        """The ``PrefillLoop`` (prefill)."""
        self.bootstrap: tuple[str, int] = ("", 0)
        """A prefill's control endpoint as Dynamo's bootstrap (host, port)."""
        self.core: Any = None
        self.events: Any = None
        self._waits: dict[str, asyncio.Future | None] = {}
        """Per running request (Dynamo's context id): the engine output it waits for, None
        while it hands a chunk over (``abort`` cancels the wait, which aborts the request)."""
        self._aborted: set[str] = set()
        """Requests ``abort`` ended: they stop at their next chunk."""

    @classmethod
    async def from_args(cls, argv: list[str] | None = None):
        args = build_parser().parse_args(argv)
        engine = cls(args)
        name = args.served_model_name or Path(args.model).name
        component = args.component or ("baton-prefill" if args.role == "prefill" else "baton")
        worker = WorkerConfig(
            namespace=args.namespace,
            component=component,
            endpoint=args.endpoint,
            model_name=args.model,
            served_model_name=name,
            discovery_backend=args.discovery_backend,
            request_plane=args.request_plane,
            event_plane=args.event_plane,
            disaggregation_mode=engine.mode,
            enable_kv_routing=not args.disable_kv_routing,
        )
        return engine, worker

    # -- start and stop --------------------------------------------------------------------
    async def start(self, worker_id: int) -> EngineConfig:
        del worker_id  # baton's rooms carry the pairing
        await asyncio.to_thread(self._load)
        args, core = self.args, self.core
        full = [c for c in core.registry if c.kind == "paged_full"]
        host, port = self.bootstrap if self.prefill is not None else (None, None)
        return EngineConfig(
            model=args.model,
            served_model_name=args.served_model_name or Path(args.model).name,
            llm=LlmRegistration(
                context_length=core.max_model_len,
                kv_cache_block_size=core.config.cache.page_size,
                total_kv_blocks=full[0].num_units if full else None,
                max_num_seqs=core.config.scheduler.max_num_seqs,
                bootstrap_host=host,
                bootstrap_port=port,
            ),
        )

    def _load(self) -> None:
        """Build the role's engine and start its thread (off the event loop: it loads the
        model)."""
        from baton.cli_serve import decode_engine, engine_options, prefill_server
        from baton.config import EngineConfig as BatonConfig
        from baton.server.async_engine import AsyncEngine
        from baton.server.prefill_app import PrefillLoop

        args = self.args
        config = BatonConfig.from_kwargs(**engine_options(args))
        if args.role == "prefill":
            server = prefill_server(args, config)
            if server is None:
                raise RuntimeError("the prefill did not start (the line above says why)")
            self.core = server.engine
            self.prefill = PrefillLoop(server)
            host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
            self.bootstrap = (host.strip("[]"), int(port))
            self.events = self._kv_events(wanted=True)
            if self.events is not None:
                self.prefill.after_turn = self.events.flush
            self.prefill.start()
            return
        if args.role == "decode":
            decode = decode_engine(args, config)
            if decode is None:
                raise RuntimeError("the decode engine did not start (the line above says why)")
            self.core, wrapped = decode.engine, decode
        else:
            from baton.engine.engine import LLMEngine as BatonEngine

            self.core = wrapped = BatonEngine(args.model, config)
        self.events = self._kv_events(wanted=args.role == "colocated")
        flush = None if self.events is None else self.events.flush
        self.engine = AsyncEngine(wrapped, keep_warm_s=config.keep_warm_s, after_step=flush)
        self.engine.start()

    def _kv_events(self, wanted: bool):
        """baton's KV-event publisher on a free loopback port, for Dynamo's ``ZmqSource``
        (``--kv-events-endpoint`` picks another), or None: not wanted (a decode), KV routing
        off, or no prefix caching."""
        from baton.cli_serve import kv_events

        args = self.args
        if not wanted or args.disable_kv_routing or self.core.prefix_cache is None:
            return None
        if not args.kv_events_endpoint:
            args.kv_events_endpoint = "tcp://127.0.0.1:*"
        return kv_events(args, self.core)

    async def kv_event_sources(self) -> list:
        if self.events is None:
            return []
        return [ZmqSource(endpoint=self.events.bound, topic=self.args.kv_events_topic)]

    async def is_quiescent(self) -> bool | None:
        """A prefill is quiescent when it holds no room (no state waiting to be pushed)."""
        if self.prefill is None:
            return None
        return self.prefill.snapshot["rooms"] == 0

    async def cleanup(self) -> None:
        """Stop the engine thread and close what it held; safe to call twice."""
        engine, self.engine = self.engine, None
        prefill, self.prefill = self.prefill, None
        events, self.events = self.events, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
            if self.args.role == "decode":
                engine.engine.close()
        if prefill is not None:
            await asyncio.to_thread(prefill.stop)
        if events is not None:
            events.close()

    # -- requests --------------------------------------------------------------------------
    async def generate(self, request: dict, context) -> AsyncGenerator[dict, None]:
        try:
            if self.prefill is not None:
                yield self._prefill_answer(request, context)
                return
            prompt = dr.prompt_ids(request)
            params = dr.sampling_params(request, self.core.max_model_len)
            route = dr.pd_route(request) if self.mode is DisaggregationMode.DECODE else None
        except InvalidRequest as exc:
            raise dynamo_errors.InvalidArgument(f"{exc.param}: {exc}") from None
        engine = self.engine
        if engine is None:
            raise dynamo_errors.EngineShutdown("the baton engine is not running")
        try:
            stream = await engine.add(prompt, params, route)
        except ValueError as exc:
            raise dynamo_errors.InvalidArgument(str(exc)) from None
        except RuntimeError as exc:
            raise dynamo_errors.EngineShutdown(str(exc)) from None
        async for chunk in self._chunks(stream, context, route):
            yield chunk

    async def _chunks(self, stream, context, route) -> AsyncGenerator[dict, None]:
        key = context.id()
        first = True
        text = self._token_text()
        cancelled = {"token_ids": [], "index": 0, "finish_reason": "cancelled"}
        try:
            while True:
                if key in self._aborted:
                    yield cancelled
                    return
                waiting = self._waits[key] = asyncio.ensure_future(anext(stream))
                try:
                    out = await waiting
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # this task was cancelled, not (only) the request
                    yield cancelled
                    return
                except StopAsyncIteration:
                    return
                self._waits[key] = None
                if first and dr.failed_before_first_token(out):
                    raise _handoff_error(out)
                if first and self.args.access_log:
                    handoff = out.metrics.handoff
                    logger.info(
                        "request %s room %s: %s",
                        key,
                        None if route is None else route.room,
                        "colocated" if handoff is None else handoff.header(),
                    )
                first = False
                chunk = dr.token_chunk(out.delta, text)
                if out.finished:
                    chunk.update(dr.final_fields(out))
                    yield chunk
                    return
                yield chunk
        finally:
            self._waits.pop(key, None)
            self._aborted.discard(key)
            await stream.aclose()  # aborts the request in the engine if it still runs

    def _token_text(self):
        tokenizer = self.core.tokenizer
        if tokenizer is None:
            return None
        return lambda token_id: tokenizer.decode([token_id])

    def _prefill_answer(self, request: dict, context) -> dict:
        """A prefill's answer: the handoff payload at once (the decode it names drives this
        prefill over the control channel). Without ``bootstrap_info``, a room drawn here."""
        info = request.get("bootstrap_info")
        if info is None:
            info = dr.bootstrap_info(*self.bootstrap, 1 + secrets.randbelow(dr.ROOM_LIMIT - 1))
        if self.args.access_log:
            logger.info("request %s room %s: prefill", context.id(), info.get("bootstrap_room"))
        prompt = len(request.get("token_ids") or [])
        return {
            "token_ids": [],
            "index": 0,
            "finish_reason": "stop",
            "disaggregated_params": info,
            "completion_usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 0,
                "total_tokens": prompt,
            },
        }

    async def abort(self, context) -> None:
        key = context.id()
        if key not in self._waits:
            return  # finished, or never ran here
        self._aborted.add(key)
        waiting = self._waits[key]
        if waiting is not None:
            waiting.cancel()


def _handoff_error(out) -> Exception:
    handoff = out.metrics.handoff
    text = out.error or "the request failed before its first token"
    if handoff is None:
        return dynamo_errors.Unknown(text)
    error = HANDOFF_ERRORS.get(handoff.reason, dynamo_errors.Unknown)
    return error(f"{handoff.header()}: {text}")
