"""The Hermes tool-call format (``--tool-call-parser hermes``): Qwen2.5, Qwen3 and the many models trained
on NousResearch's Hermes function-calling format.

Each call is a JSON object between tags, one region per call, as Qwen's chat templates render an assistant
turn's ``tool_calls`` (and instruct the model to write them)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Checked against Qwen3's chat template (``<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}
\\n</tool_call>``) and vLLM's ``hermes`` parser (vllm/tool_parsers/hermes_tool_parser.py), which also takes
a final region whose end tag never came when its JSON is complete.
"""

from __future__ import annotations

from typing import Any

from atomtool.serve.api.tool_parsers.base import ParsedBody, TaggedToolCallStream, strict_json


class HermesToolCallStream(TaggedToolCallStream):
    """Incremental Hermes parser. A body is one JSON object with a string ``name`` and ``arguments`` (an
    object; a string holding a JSON object is taken too; absent: ``{}``); anything else (invalid JSON, a
    missing name) is malformed and stays content, as vLLM answers invalid JSON."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str) -> ParsedBody:
        obj = strict_json(body.strip())
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        arguments: Any = obj.get("arguments", {})
        if isinstance(arguments, str):
            arguments = strict_json(arguments) if arguments.strip() else {}
        if not isinstance(arguments, dict):
            return None
        return [(obj["name"], arguments)]
