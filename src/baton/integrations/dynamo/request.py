"""NVIDIA Dynamo's backend dicts in baton's terms -- imports nothing of Dynamo's.

Dynamo's Rust frontend tokenizes, applies the chat template, detokenizes and cuts stop
strings; a backend's ``generate(request, context)`` gets a ``PreprocessedRequest`` dict
(``token_ids``, ``sampling_options``, ``stop_conditions``, ``output_options``, and for PD
``bootstrap_info`` or ``prefill_result``) and yields chunks ``{"token_ids": [...], "index":
0}``, the last with ``finish_reason`` and ``completion_usage``. This module turns the one into
``SamplingParams`` and a ``PDRoute``, and baton's outputs into the other;
``worker`` does the rest.

Every option baton takes maps: temperature, top-p/k, min-p, seed, the three penalties, min
and max tokens, ``ignore_eos``, the model's hidden stop ids (its EOS: Dynamo sends them in
``stop_token_ids_hidden``), ``logprobs`` and ``guided_decoding`` (structured outputs: json,
regex, choice, Lark grammar). Stop *strings* stay with Dynamo's detokenizer, as for its other
engines (it ends the stream, which aborts the request here). What baton does not do yet is
refused by name (``InvalidRequest`` with the field): ``n``/``best_of`` above 1 (a Dynamo
backend streams one choice per request here), beam search, ``guided_decoding.structural_tag``
and ``prompt_logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from baton.engine.core import PDRoute
from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.sampling_params import InvalidRequest, SamplingParams, StructuredOutputsParams

ROOM_LIMIT = 2**63
"""A room is in [1, 2**63): baton's rooms, and the signed 64-bit range Dynamo draws from."""

SAMPLING_OPTIONS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
"""``sampling_options`` fields that are ``SamplingParams`` fields of the same name."""

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}
"""baton's finish reason -> the one Dynamo's Rust layer knows."""


def _section(request: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = request.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{name} must be an object, got {type(value).__name__}", name)
    return value


def prompt_ids(request: Mapping[str, Any]) -> list[int]:
    """The request's ``token_ids``, checked (a non-empty list of non-negative ints)."""
    ids = request.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise InvalidRequest("token_ids must be a non-empty list of token ids", "token_ids")
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidRequest(f"token_ids holds {token_id!r}, not a token id", "token_ids")
    return ids


def sampling_params(request: Mapping[str, Any], max_model_len: int) -> SamplingParams:
    """``SamplingParams`` of a Dynamo request; ``InvalidRequest`` naming the field that baton
    refuses or that is out of range. No ``max_tokens``: up to the context's end."""
    options = _section(request, "sampling_options")
    stop = _section(request, "stop_conditions")
    output = _section(request, "output_options")
    for name in ("n", "best_of"):
        if options.get(name) not in (None, 1):
            raise InvalidRequest(f"{name}={options[name]!r}: baton serves one choice", name)
    if options.get("use_beam_search"):
        raise InvalidRequest("beam search is not supported by baton", "use_beam_search")
    structured = _guided_decoding(options.get("guided_decoding"))
    if output.get("prompt_logprobs") is not None:
        raise InvalidRequest("prompt_logprobs are not supported by baton", "prompt_logprobs")
    kwargs = {name: options[name] for name in SAMPLING_OPTIONS if options.get(name) is not None}
    for name in ("min_tokens", "ignore_eos"):
        if stop.get(name) is not None:
            kwargs[name] = stop[name]
    max_tokens = stop.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(1, max_model_len - len(prompt_ids(request)))
    # NOTE: the hidden stop ids are the model's EOS ids; ``ignore_eos`` means past them.
    hidden = [] if kwargs.get("ignore_eos") else list(stop.get("stop_token_ids_hidden") or [])
    return SamplingParams(
        max_tokens=max_tokens,
        stop_token_ids=hidden or None,
        logprobs=output.get("logprobs"),
        structured_outputs=structured,
        **kwargs,
    )


GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""``guided_decoding`` fields that are ``StructuredOutputsParams`` fields of the same name."""


def _guided_decoding(guided: Any) -> StructuredOutputsParams | None:
    """Dynamo's ``guided_decoding`` (its frontend's ``response_format`` / vLLM extras) as
    ``StructuredOutputsParams``; what baton cannot constrain (``structural_tag``, a
    ``whitespace_pattern``) is refused by name. ``backend`` names the engine vLLM would use:
    baton has one (llguidance), so it is not read."""
    if guided is None:
        return None
    if not isinstance(guided, Mapping):
        raise InvalidRequest("guided_decoding must be an object", "guided_decoding")
    for name in ("structural_tag", "whitespace_pattern"):
        if guided.get(name) is not None:
            raise InvalidRequest(
                f"guided_decoding.{name} is not supported by baton", f"guided_decoding.{name}"
            )
    given = {k: guided[k] for k in GUIDED_KINDS if guided.get(k) not in (None, False)}
    if not given:
        return None
    if "json" in given and isinstance(given["json"], Mapping):
        given["json"] = dict(given["json"])
    return StructuredOutputsParams(**given)


def pd_route(request: Mapping[str, Any]) -> PDRoute | None:
    """The prefill a decode request names: Dynamo's ``bootstrap_info`` (its PrefillRouter
    sends it to prefill and decode at once), else the ``disaggregated_params`` of a
    ``prefill_result`` (a prefill answered first); None when neither is there."""
    info = request.get("bootstrap_info")
    if info is None:
        info = _section(request, "prefill_result").get("disaggregated_params")
    if info is None:
        return None
    if not isinstance(info, Mapping):
        raise InvalidRequest("bootstrap_info must be an object", "bootstrap_info")
    host, port, room = (info.get(f"bootstrap_{k}") for k in ("host", "port", "room"))
    if not isinstance(host, str) or not host:
        raise InvalidRequest(f"bootstrap_host must name a host, got {host!r}", "bootstrap_info")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidRequest(f"bootstrap_port must be a port, got {port!r}", "bootstrap_info")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 < room < ROOM_LIMIT:
        raise InvalidRequest(
            f"bootstrap_room must be in [1, 2**63), got {room!r}", "bootstrap_info"
        )
    address = f"[{host}]" if ":" in host else host
    return PDRoute(prefill=f"tcp://{address}:{port}", room=room)


def bootstrap_info(host: str, port: int, room: int) -> dict[str, Any]:
    """A prefill's handoff payload (``disaggregated_params``), as Dynamo's SGLang-style
    engines spell it."""
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def token_chunk(delta: CompletionOutput | None, token_text: Any = None) -> dict[str, Any]:
    """One streamed chunk: the step's new token ids, and their logprobs when asked for
    (``log_probs``: the sampled tokens'; ``top_logprobs``: per token, every logprob baton
    returned -- the top n and the sampled one -- best first, ranked). ``token_text(id)``
    names a token; None: ``token_id:N``."""
    if delta is None:
        return {"token_ids": [], "index": 0}
    chunk: dict[str, Any] = {"token_ids": list(delta.token_ids), "index": 0}
    if delta.logprobs is not None:
        name = token_text or (lambda token_id: f"token_id:{token_id}")
        chunk["log_probs"] = [lp[t] for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)]
        chunk["top_logprobs"] = [
            [
                {"rank": rank, "token_id": t, "token": name(t), "logprob": value}
                for rank, (t, value) in enumerate(
                    sorted(lp.items(), key=lambda item: -item[1]), start=1
                )
            ]
            for lp in delta.logprobs
        ]
    return chunk


def usage(out: RequestOutput) -> dict[str, Any]:
    """``completion_usage`` of a finished request (cached prompt tokens included)."""
    prompt = len(out.prompt_token_ids)
    completion = len(out.outputs[0].token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
    }


def final_fields(out: RequestOutput) -> dict[str, Any]:
    """What the last chunk adds: the finish reason in Dynamo's words, the usage, and the PD
    handoff's outcome (``engine_data.baton_handoff``: the ``x-baton-handoff`` value)."""
    reason = out.outputs[0].finish_reason or "stop"
    fields: dict[str, Any] = {
        "finish_reason": FINISH_REASONS.get(reason, reason),
        "completion_usage": usage(out),
    }
    if out.metrics.handoff is not None:
        fields["engine_data"] = {"baton_handoff": out.metrics.handoff.header()}
    return fields


def failed_before_first_token(out: RequestOutput) -> bool:
    """Whether ``out`` (a request's first output) is its end, an error, with no token: a
    PD handoff that failed (``out.metrics.handoff`` says why)."""
    first = out.outputs[0]
    return out.finished and first.finish_reason == "error" and not first.token_ids
