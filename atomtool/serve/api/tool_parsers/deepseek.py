"""DeepSeek's tool-call formats: V3.1 (``--tool-call-parser deepseek_v31``) and V3.2's DSML
(``deepseek_v32``). Both write one block holding every call of the turn.

V3.1, as the chat template of deepseek-ai/DeepSeek-V3.1 renders an assistant turn's ``tool_calls`` (mirrored in
llama.cpp's models/templates/deepseek-ai-DeepSeek-V3.1.jinja) and vLLM's ``deepseek_v31`` parser reads it
(vllm/tool_parsers/deepseekv31_tool_parser.py); the arguments are the JSON text::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.2 (DSML), as vLLM's ``deepseek_v32`` parser reads it (vllm/tool_parsers/deepseekv32_tool_parser.py) and the
DeepSeek-V3.2 template in llama.cpp (models/templates/DeepSeek-V3.2.jinja, a port of DeepSeek's encoding
script) writes it; a parameter with ``string="true"`` is the text as is, any other is JSON::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

(``｜`` is U+FF5C FULLWIDTH VERTICAL LINE, ``▁`` U+2581 LOWER ONE EIGHTH BLOCK.) A non-string DSML value that is
not JSON is kept as the text (vLLM coerces it by the tool's schema instead).
"""

from __future__ import annotations

import re
from typing import Any

from atomtool.serve.api.tool_parsers.base import ParsedBody, TaggedToolCallStream, strict_json

_V31_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DSML = "｜DSML｜"
_INVOKE = re.compile(rf'\s*<{_DSML}invoke\s+name="([^"]+)"\s*>(.*?)</{_DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'\s*<{_DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)</{_DSML}parameter>',
                    re.DOTALL)


def _sequence(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """The matches of ``pattern`` one after another from the start of ``text``, or None when anything but
    whitespace is left between or after them."""
    matches, pos = [], 0
    while (m := pattern.match(text, pos)) is not None:
        matches.append(m)
        pos = m.end()
    return matches if not text[pos:].strip() else None


def _name(raw: str) -> str | None:
    name = raw.strip()
    return name if name and "<" not in name and ">" not in name else None


class DeepSeekV31ToolCallStream(TaggedToolCallStream):
    """Incremental DeepSeek-V3.1 parser: a block of ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON<｜tool▁call▁end｜>``
    calls, each JSON an object; anything else in the block makes it malformed (it stays content)."""

    start_tag = "<｜tool▁calls▁begin｜>"
    end_tag = "<｜tool▁calls▁end｜>"

    def parse_body(self, body: str) -> ParsedBody:
        matches = _sequence(_V31_CALL, body)
        if not matches:
            return None
        calls = []
        for m in matches:
            name, arguments = _name(m.group(1)), strict_json(m.group(2).strip())
            if name is None or not isinstance(arguments, dict):
                return None
            calls.append((name, arguments))
        return calls


class DeepSeekV32ToolCallStream(TaggedToolCallStream):
    """Incremental DeepSeek-V3.2 (DSML) parser: a ``function_calls`` block of ``invoke`` elements, each of
    ``parameter`` elements; anything else in the block makes it malformed (it stays content)."""

    start_tag = f"<{_DSML}function_calls>"
    end_tag = f"</{_DSML}function_calls>"

    def parse_body(self, body: str) -> ParsedBody:
        invokes = _sequence(_INVOKE, body)
        if not invokes:
            return None
        calls = []
        for inv in invokes:
            name, params = _name(inv.group(1)), _sequence(_PARAM, inv.group(2))
            if name is None or params is None:
                return None
            arguments: dict[str, Any] = {}
            for p in params:
                key, is_string, value = p.group(1), p.group(2) == "true", p.group(3)
                if is_string:
                    arguments[key] = value
                else:
                    try:
                        arguments[key] = strict_json(value.strip())
                    except ValueError:
                        arguments[key] = value
            calls.append((name, arguments))
        return calls
