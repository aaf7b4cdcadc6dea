"""The GLM-4.5 / GLM-4.6 / GLM-4.7 tool-call format (``--tool-call-parser glm45``, alias ``glm47``): a call is
the function name then key/value tag pairs, one region per call, as GLM-4.6's chat template renders an
assistant turn's ``tool_calls``::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The template writes a string value as is and any other value as JSON (``v | tojson if v is not string else
v``), so a value is decoded as JSON when it parses and kept as the text otherwise; when the request's tool
schema types the parameter as ``"string"``, the text is kept as is (``"123"`` stays a string), as vLLM's
``glm45`` parser does (vllm/tool_parsers/glm4_moe_tool_parser.py; it also tries Python literals, which this
parser does not). GLM-4.7 and later (vLLM's ``glm47`` parser, which vLLM's recipes use for GLM-5/5.1) may put
the first ``<arg_key>`` right after the name with no newline, and may write a call with no arguments; both
are accepted here, so ``glm47`` names the same parser.

Checked against GLM-4.6's chat template (as mirrored in llama.cpp's models/templates/GLM-4.6.jinja) and vLLM's
``glm45``/``glm47`` parsers. GLM-5's chat template from zai-org was not available to check; vLLM's recipes
serve GLM-5/5.1 with ``glm47``, and a GLM-5 template copy in a third-party repository writes the GLM-4.7 form
(``'<tool_call>' ~ name`` then ``<arg_key>`` pairs with no newlines, strings as is, other values ``tojson``),
which this parser reads (tests/test_tool_parsers.py renders both forms and parses them back).
"""

from __future__ import annotations

import re
from typing import Any

from atomtool.serve.api.tool_parsers.base import ParsedBody, TaggedToolCallStream, strict_json

_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def string_params(tools: list[dict[str, Any]], name: str) -> set[str]:
    """The parameters of function ``name`` whose JSON schema type is ``"string"`` (empty when the function or
    its schema is unknown)."""
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


class Glm45ToolCallStream(TaggedToolCallStream):
    """Incremental GLM-4.5 parser. A body is a name (up to the first newline or ``<arg_key>``; no ``<`` in
    it) followed by ``<arg_key>``/``<arg_value>`` pairs and nothing but whitespace between them; anything else
    is malformed and stays content. A call whose ``</tool_call>`` never came is content too (vLLM's ``glm45``
    reads calls only between both tags): cut after any pair, it would parse with arguments missing."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    open_region_counts = False

    def parse_body(self, body: str) -> ParsedBody:
        cut = [i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0]
        end = min(cut) if cut else len(body)
        name = body[:end].strip()
        if not name or "<" in name or ">" in name:
            return None
        strings = string_params(self.tools, name)
        arguments: dict[str, Any] = {}
        pos = end
        while True:
            m = _PAIR.match(body, pos)
            if m is None:
                break
            key, value = m.group(1).strip(), m.group(2)
            if key in strings:
                arguments[key] = value
            else:
                try:
                    arguments[key] = strict_json(value.strip())
                except ValueError:
                    arguments[key] = value.strip()
            pos = m.end()
        if body[pos:].strip():
            return None
        return [(name, arguments)]
