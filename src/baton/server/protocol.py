"""OpenAI request models for ``/v1/completions`` and ``/v1/chat/completions``, and their
conversion to ``SamplingParams``.

Unknown fields that do not change the output (``user``, ``metadata``, ...) are ignored;
known fields this server cannot honour (``logit_bias``, ``suffix``, ...)
raise ``ApiError`` (a 400), never silently produce a different answer. Tools (``tools``,
``tool_choice``, the messages of a tool round trip) are checked by ``tools.py``. The
headers of PD routing are ``route_headers.py``'s.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Strict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from baton.sampling_params import InvalidRequest, SamplingParams, StructuredOutputsParams
from baton.server.prompt_batch import MAX_PROMPTS
from baton.server.tools import ToolUse, message_tool_fields, tool_use, tools_grammar

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


class ApiError(Exception):
    """An error the client caused or must see: rendered as OpenAI's error JSON."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param = message, status_code, param
        self.type, self.code = type, code
        self.headers = headers or {}
        """Sent with the error response (a PD decode's ``HANDOFF_HEADER``)."""

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def route_not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors -- no route for the path (404), not for that method (405) --
    as OpenAI's error JSON, like every other error of baton's apps (an exception handler)."""
    codes = {404: "not_found", 405: "method_not_allowed"}
    message = f"{exc.detail}: {request.method} {request.url.path}"
    if exc.status_code == 404 and request.url.path.startswith("/v1/"):
        # e.g. /v1/responses, /v1/embeddings: say what this server does answer.
        served = sorted(
            {r.path for r in request.app.routes if getattr(r, "path", "").startswith("/v1/")}
        )
        message += f"; this server serves {', '.join(served)}"
    error = ApiError(message, exc.status_code, code=codes.get(exc.status_code))
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


def response_format_constraint(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as ``StructuredOutputsParams`` fields (None for
    ``text``); a 400 naming what is wrong."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(
                "response_format.json_schema must be an object with a 'schema'",
                param="response_format.json_schema",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ApiError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return {"json": schema}
    raise ApiError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Bool = False


class _SamplingRequest(BaseModel):
    """Fields the two endpoints share (OpenAI names plus vLLM's common extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Str
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    user: Str | None = None
    logit_bias: dict[str, Any] | None = None
    # vLLM extras: accepted because clients of vLLM send them.
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    response_format: dict[str, Any] | None = None
    """OpenAI's: ``text``, ``json_object`` or ``json_schema`` (completions too, as vLLM)."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``."""
    guided_json: dict[str, Any] | Str | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    """vLLM's older names of the same constraints."""
    # SGLang's PD fields, as llm-d's sidecar sends them to a decode (``bootstrap_route``).
    bootstrap_host: Str | None = None
    bootstrap_port: Int | None = None
    bootstrap_room: Int | None = None

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise ApiError("logit_bias is not supported", param="logit_bias")

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for, or None; a 400 naming the field for
        two at once or one this server cannot read."""
        asked = {}
        if self.response_format is not None:
            found = response_format_constraint(self.response_format)
            if found is not None:
                asked["response_format"] = found
        if self.structured_outputs is not None:
            asked["structured_outputs"] = dict(self.structured_outputs)
        legacy = {
            "guided_json": "json",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
        }
        for name, kind in legacy.items():
            if getattr(self, name) is not None:
                asked[name] = {kind: getattr(self, name)}
        if len(asked) > 1:
            raise ApiError(
                f"{' and '.join(asked)} both constrain the output; send one", param=list(asked)[1]
            )
        if not asked:
            return None
        field, spec = next(iter(asked.items()))
        try:
            return StructuredOutputsParams(**spec)
        except TypeError as exc:  # an unknown key
            raise ApiError(f"{field}: {exc}", param=field) from None
        except InvalidRequest as exc:
            param = field if exc.param in (None, "structured_outputs") else exc.param
            raise ApiError(str(exc).replace("structured_outputs", field), param=param) from exc

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, best_of: int | None = None
    ) -> SamplingParams:
        self._check_unsupported()
        if max_tokens is not None and max_tokens <= 0:
            raise ApiError(f"max_tokens must be positive, got {max_tokens}", param="max_tokens")
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        kwargs = {k: v for k, v in given.items() if v is not None}
        try:
            return SamplingParams(
                n=self.n,
                best_of=best_of,
                max_tokens=max_tokens,
                stop=self.stop,
                logprobs=logprobs,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                structured_outputs=self._structured_outputs(),
                **kwargs,
            )
        except InvalidRequest as exc:
            raise ApiError(str(exc), param=exc.param) from exc

    def bootstrap_route(self) -> tuple[str, int] | None:
        """(prefill control endpoint, room) from the SGLang-style body fields (llm-d's
        sidecar: ``bootstrap_host`` and ``bootstrap_port`` name the prefill's ``--pd-host``
        and ``--pd-port``), None where none is given; a 400 naming the field at fault."""
        fields = {
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": self.bootstrap_room,
        }
        if all(v is None for v in fields.values()):
            return None
        missing = [name for name, v in fields.items() if v is None]
        if missing:
            raise ApiError(
                f"{missing[0]} is missing: bootstrap_host, bootstrap_port and bootstrap_room "
                "come together",
                param=missing[0],
            )
        host, port, room = self.bootstrap_host, self.bootstrap_port, self.bootstrap_room
        if not host or any(c in host for c in "/ []") or host.count(":") == 1:
            raise ApiError(
                f"bootstrap_host must be a host name or address, got {host!r}",
                param="bootstrap_host",
            )
        if not 0 < port < 65536:
            raise ApiError(
                f"bootstrap_port must be in [1, 65535], got {port}", param="bootstrap_port"
            )
        if not 0 < room < 2**63:
            raise ApiError(
                f"bootstrap_room must be in [1, 2**63), got {room}", param="bootstrap_room"
            )
        return (f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"), room

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Str | list[Int] | list[Str] | list[list[Int]]
    max_tokens: Int | None = 16  # OpenAI's default for completions
    logprobs: Int | None = None
    echo: Bool = False
    best_of: Int | None = None
    suffix: Str | None = None

    def engine_prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (a string or token ids) or several (a list of either;
        at most ``MAX_PROMPTS``), none of them empty."""
        prompt = self.prompt
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = list(prompt) if several else [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(
                f"prompt has {len(prompts)} prompts; this server takes at most {MAX_PROMPTS} "
                "per request",
                param="prompt",
            )
        for i, one in enumerate(prompts):
            if not one:
                where = f"prompt[{i}]" if several else "prompt"
                raise ApiError(f"{where} is empty", param="prompt")
        return prompts

    def sampling_params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            raise ApiError(
                "echo with logprobs is not supported: the prompt's logprobs are not computed",
                param="echo",
            )
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ApiError(
                f"best_of={self.best_of} > n={self.n} cannot stream (as OpenAI): the "
                "completions not chosen would be streamed too",
                param="best_of",
            )
        if self.suffix:
            raise ApiError("suffix is not supported", param="suffix")
        return self._sampling_params(self.max_tokens, self.logprobs, self.best_of)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Str
    content: Str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None
    """An assistant's calls, OpenAI's shape (``function.arguments`` a JSON text)."""
    tool_call_id: Str | None = None
    """A ``tool`` message's answer to which call."""

    def as_template_dict(self, index: int) -> dict[str, Any]:
        """The message as transformers passes it to a chat template (the tool calls'
        arguments as objects: ``tools.message_tool_fields``); a 400 naming the field."""
        try:
            tools = message_tool_fields(index, self.role, self.tool_calls, self.tool_call_id)
        except InvalidRequest as exc:
            raise ApiError(str(exc), param=exc.param) from exc
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError("only text content parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        extra = self.model_extra or {}
        return {**extra, "role": self.role, "content": content or "", **tools}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    tool_choice: Str | dict[str, Any] | None = None
    """``none``, ``auto`` (the default with tools), ``required`` or a named function."""
    parallel_tool_calls: Bool = True

    def tool_use(self) -> ToolUse | None:
        """What the request asks of tools (None: it gives none); a 400 naming the field."""
        try:
            return tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidRequest as exc:
            raise ApiError(str(exc), param=exc.param) from exc

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The body's own constraint, or the grammar of ``required`` / a named function;
        a 400 where tools may be called and another constraint is asked for too."""
        constraint = super()._structured_outputs()
        given = None
        if constraint is not None:  # the field super() took it from
            fields = [f for f in _CONSTRAINT_FIELDS if getattr(self, f) is not None]
            is_text = fields[0] == "response_format" and self.response_format["type"] == "text"
            given = fields[1] if is_text else fields[0]
        try:
            grammar = tools_grammar(self.tool_use(), given)
        except InvalidRequest as exc:
            raise ApiError(str(exc), param=exc.param) from exc
        return constraint if grammar is None else StructuredOutputsParams(grammar=grammar)

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.max_completion_tokens is not None and self.max_completion_tokens <= 0:
            raise ApiError("max_completion_tokens must be positive", param="max_completion_tokens")
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise ApiError("messages must not be empty", param="messages")
        return [m.as_template_dict(i) for i, m in enumerate(self.messages)]


_CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
"""The fields that constrain a chat's output besides its tools, in ``_structured_outputs``'s
order of precedence."""
