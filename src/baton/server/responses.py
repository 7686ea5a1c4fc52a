"""OpenAI's Responses API, its stateless basic subset: ``POST /v1/responses`` with ``input``
(text, or messages of text parts), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (``json_schema`` / ``json_object``: a structured output) and
``stream`` (the semantic events: ``response.created`` ... ``response.output_text.delta`` ...
``response.completed``). A request becomes the chat completion it means (``chat_request``:
instructions as the system message) and runs as one; the answer is one ``message`` output
item with one ``output_text`` part.

Refused by name (a 400): what needs state this server does not keep (``previous_response_id``,
``conversation``), tools, and input items other than messages. Who calls it: ``api.py``'s
``/v1/responses`` route; it builds bodies and events only.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict

from baton.engine.outputs import RequestOutput
from baton.server.protocol import ApiError, Bool, ChatCompletionRequest, Float, Int, Str

ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Str
    input: Str | list[dict[str, Any]]
    instructions: Str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: Bool = False
    text: dict[str, Any] | None = None
    previous_response_id: Str | None = None
    conversation: Any = None
    tools: list[Any] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request means; a 400 naming what is not served."""
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise ApiError(
                    f"{name} needs stored responses; this server is stateless: send the "
                    "whole conversation as input",
                    param=name,
                )
        if self.tools:
            raise ApiError(
                "tools are served on /v1/chat/completions, not on /v1/responses", param="tools"
            )
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += self._messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        given = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": self._response_format(),
        }
        body.update({k: v for k, v in given.items() if v is not None})
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if item.get("type", "message") != "message" or item.get("role") not in ROLES:
                raise ApiError(
                    f"{where}: only messages (role {', '.join(ROLES)}) are served here",
                    param=where,
                )
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        return messages

    def _response_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``."""
        form = (self.text or {}).get("format")
        if form is None or form.get("type") == "text":
            return None
        if form.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {"schema": form.get("schema", {})}}
        return form  # json_object, or what response_format refuses by name


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                raise ApiError(f"{where}.content: only text parts are served", param=where)
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(f"{where}.content must be text or a list of text parts", param=where)


def _usage(out: RequestOutput) -> dict[str, Any]:
    num_input = len(out.prompt_token_ids)
    num_output = len(out.outputs[0].token_ids)
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output,
    }


class ResponseBody:
    """The bodies and events of one response (its ids, what was asked)."""

    def __init__(self, req: ResponsesRequest, model_name: str) -> None:
        self.req, self.model_name = req, model_name
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def item(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        content = [part] if status == "completed" else []
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def response(self, out: RequestOutput | None) -> dict[str, Any]:
        """The response object; ``out`` None: just created."""
        status, incomplete, output, usage = "in_progress", None, [], None
        if out is not None:
            completion = out.outputs[0]
            cut = completion.finish_reason == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            output, usage = [self.item(completion.text, "completed")], _usage(out)
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "incomplete_details": incomplete,
            "error": None,
            "model": self.model_name,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "output": output,
            "usage": usage,
        }

    async def events(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """The stream's semantic events, numbered (``sequence_number``)."""
        number = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal number
            number += 1
            data = {"type": kind, "sequence_number": number - 1, **fields}
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        empty = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.created", response=self.response(None))
        yield event("response.in_progress", response=self.response(None))
        yield event("response.output_item.added", output_index=0, item=self.item("", "in_progress"))
        yield event("response.content_part.added", part=empty, **at)
        last = None
        try:
            async for out in outputs:
                last = out
                if out.delta is not None and out.delta.text:
                    yield event("response.output_text.delta", delta=out.delta.text, **at)
        finally:
            await outputs.aclose()
        if last is None:
            return
        text = last.outputs[0].text
        done = {"type": "output_text", "text": text, "annotations": []}
        yield event("response.output_text.done", text=text, **at)
        yield event("response.content_part.done", part=done, **at)
        yield event("response.output_item.done", output_index=0, item=self.item(text, "completed"))
        final = self.response(last)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield event(kind, response=final)
