"""``baton serve --role prefill``: a ``PrefillServer`` loop thread behind a small HTTP app.

Prefill takes its work over the PD control channel (decode sends ``ReserveState``), so its
HTTP side answers ``/health`` (200 with the control endpoint a router hands to decode,
while the loop thread turns; 503 otherwise), ``/metrics`` (Prometheus: requests in flight,
waiting and finished, units per state component and their share of the capacity, bytes and
seconds pushed per component) and -- for llm-d's SGLang-style sidecar, which sends the
request to prefill and decode at once with ``bootstrap_host`` / ``bootstrap_port`` /
``bootstrap_room`` in the body -- ``POST /v1/completions`` and ``/v1/chat/completions``:
an empty answer at once (the decode named in no field drives this prefill over the control
channel; its answer is the decode's).

The loop thread owns the ``PrefillServer``; it copies what ``/metrics`` reads into a
snapshot after every turn, so the HTTP thread never touches engine state.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.engine.stats import kv_usage
from baton.server.metrics import TotalCounter
from baton.server.protocol import ApiError, route_not_found
from baton.server.request_body import read_body
from baton.transfer.prefill import PrefillServer

logger = logging.getLogger(__name__)

SIDECAR_BODY_LIMIT = 16 * 2**20
"""Largest OpenAI request body the prefill reads (a sidecar's copy of the decode's)."""
STALL_LIMIT_S = 60.0
"""``/health`` answers 503 once the loop has not turned for this long (a wedged step)."""


class PrefillLoop:
    """Runs ``server.serve_once`` on its own thread (``start``) or the caller's (``run_here``)
    until ``stop``; closes the server then."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.snapshot: dict = {
            "rooms": 0,
            "units": {},
            "capacity": {},
            "waiting": 0,
            "bytes": {},
            "seconds": {},
            "requests": {"done": 0, "failed": 0},
        }
        self._thread = threading.Thread(target=self._run, name="baton-prefill", daemon=True)
        self.on_failure: Callable[[], None] | None = None
        self.after_turn: Callable[[], object] | None = None
        """Called on the loop's thread after every turn (KV events)."""
        """Called on the loop's thread after it failed and closed (``baton serve`` exits)."""

    def start(self) -> PrefillLoop:
        self._thread.start()
        return self

    def run_here(self) -> None:
        """Run the loop on the calling thread until ``stop`` (instead of ``start``): ``baton
        serve`` runs it on the main thread, where MKL's matmuls are faster (see
        ``baton.server.async_engine.AsyncEngine.run_here``)."""
        self._thread = threading.current_thread()
        self._run()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        stalled = time.monotonic() - self.server.last_turn > STALL_LIMIT_S
        return self._thread.is_alive() and self.error is None and not stalled

    def _run(self) -> None:
        server = self.server
        try:
            while not self.stop_event.is_set():
                server.serve_once()
                if self.after_turn is not None:
                    self.after_turn()
                self.snapshot = {
                    "rooms": len(server.rooms),
                    "units": server.engine.units_in_use(),
                    "capacity": server.engine.unit_capacity(),
                    "waiting": server.engine.num_waiting,
                    "bytes": dict(server.component_bytes),
                    "seconds": dict(server.component_seconds),
                    "requests": dict(server.num_requests),
                }
        except Exception as exc:
            logger.exception("the prefill loop failed")
            self.error = exc
        finally:
            server.close()
        if self.error is not None and self.on_failure is not None:
            self.on_failure()


def build_prefill_app(loop: PrefillLoop) -> FastAPI:
    app = FastAPI(title="baton prefill", docs_url=None, redoc_url=None)
    app.add_exception_handler(StarletteHTTPException, route_not_found)
    app.add_exception_handler(
        ApiError, lambda _, exc: JSONResponse(exc.body(), status_code=exc.status_code)
    )
    r = CollectorRegistry()
    in_flight = Gauge(
        "baton_prefill_requests_in_flight", "rooms being computed or pushed", registry=r
    )
    finished = TotalCounter("baton_prefill_requests", "rooms ended, by outcome", r, "outcome")
    waiting = Gauge(
        "baton_num_requests_waiting", "requests queued for their prompt step", registry=r
    )
    units = Gauge(
        "baton_units_in_use", "units held per state component (pool)", ["component"], registry=r
    )
    usage = Gauge(
        "baton_kv_cache_usage_ratio",
        "units in use / units in all, every state component together (0..1)",
        registry=r,
    )
    pushed = TotalCounter(
        "baton_transfer_bytes", "state bytes pushed per component", r, "component"
    )
    seconds = TotalCounter(
        "baton_transfer_seconds", "seconds spent pushing per component", r, "component"
    )

    @app.get("/health")
    async def health() -> Response:
        if not loop.is_alive:
            error = ApiError("the prefill loop is not running", 503, type="server_error")
            return JSONResponse(error.body(), status_code=503)
        server = loop.server
        return JSONResponse(
            {
                "status": "ok",
                "role": "prefill",
                "pd_endpoint": server.endpoint,
                "worker_id": server.hello.worker_id,
                "platform": server.engine.platform_info,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = loop.snapshot
        in_flight.set(snap["rooms"])
        waiting.set(snap["waiting"])
        for name, n in snap["units"].items():
            units.labels(name).set(n)
        usage.set(kv_usage(snap["units"], snap["capacity"]))
        for outcome, n in snap["requests"].items():
            finished.set_total(n, outcome)
        for name, n in snap["bytes"].items():
            pushed.set_total(n, name)
        for name, s in snap["seconds"].items():
            seconds.set_total(s, name)
        return Response(generate_latest(r), media_type=CONTENT_TYPE_LATEST)

    async def sidecar_request(request: Request) -> Response:
        body = await read_body(request, SIDECAR_BODY_LIMIT)
        try:
            data = json.loads(body)
        except ValueError:
            return JSONResponse(ApiError("the body is not JSON").body(), status_code=400)
        room = data.get("bootstrap_room") if isinstance(data, dict) else None
        if isinstance(room, bool) or not isinstance(room, int):
            error = ApiError(
                "a prefill takes its requests from decode over the PD control channel; an "
                "OpenAI request here must carry bootstrap_room (llm-d's SGLang-style sidecar)",
                param="bootstrap_room",
            )
            return JSONResponse(error.body(), status_code=400)
        if data.get("stream") is True:
            return Response("data: [DONE]\n\n", media_type="text/event-stream")
        head = {"id": f"prefill-{room}", "object": "text_completion", "created": int(time.time())}
        return JSONResponse({**head, "model": data.get("model"), "choices": [], "room": room})

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, sidecar_request, methods=["POST"])
    return app
