"""What the tool-calling tests share: a ChatML chat template with tools written like Qwen3's
(tools listed in ``<tools></tools>`` in the system turn, calls as ``<tool_call>`` blocks,
results as ``<tool_response>`` in a user turn), and tools with schemas a model can finish
(enums, booleans, bounded integers and strings: a random model under a grammar must reach
the end within a few dozen tokens)."""

from __future__ import annotations

import shutil
from pathlib import Path

TOOLS_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nCall them as <tool_call>{"name": ..., "arguments": ...}</tool_call>' }}
{{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + message.content }}
{%- for tool_call in message.tool_calls | default([]) %}
{%- if loop.first and message.content or not loop.first %}{{- '\n' }}{%- endif %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"$ref": "#/$defs/unit"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
            "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "loud": {"type": "boolean"},
                "label": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            },
            "required": ["hour", "loud", "label"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ALARM]


def with_tools_template(model_dir: Path, into: Path) -> Path:
    """A copy of ``model_dir`` whose chat template is ``TOOLS_TEMPLATE``."""
    shutil.copytree(model_dir, into)
    (into / "chat_template.jinja").write_text(TOOLS_TEMPLATE, encoding="utf-8")
    return into
