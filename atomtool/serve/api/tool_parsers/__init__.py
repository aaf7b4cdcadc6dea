"""Tool-call parsers: the model's tool calls, written in its own markup in the generated text, as OpenAI's
``message.tool_calls`` (non-streaming) and tool-call deltas (streaming), as vLLM's ``--tool-call-parser``.

``atomtool serve --tool-call-parser NAME`` picks one of :data:`TOOL_PARSERS` by name; the server then parses
the text of chat requests that send ``tools`` (and do not set ``tool_choice`` ``"none"``). One module per
format, each naming the chat template / reference parser it was checked against:

- ``hermes`` (:mod:`.hermes`): Qwen2.5/Qwen3 and Hermes-style models, ``<tool_call>{json}</tool_call>``;
- ``glm45`` / ``glm47`` (:mod:`.glm45`): GLM-4.5/4.6/4.7 (and GLM-5 as vLLM serves it),
  ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``;
- ``deepseek_v31`` and ``deepseek_v32`` (:mod:`.deepseek`): DeepSeek-V3.1's ``<｜tool▁calls▁begin｜>`` block and
  DeepSeek-V3.2's DSML ``<｜DSML｜function_calls>`` block.
"""

from __future__ import annotations

from atomtool.errors import ConfigError
from atomtool.serve.api.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    TaggedToolCallStream,
    ToolCall,
    ToolParser,
)
from atomtool.serve.api.tool_parsers.deepseek import DeepSeekV31ToolCallStream, DeepSeekV32ToolCallStream
from atomtool.serve.api.tool_parsers.glm45 import Glm45ToolCallStream
from atomtool.serve.api.tool_parsers.hermes import HermesToolCallStream

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "StreamDelta", "TaggedToolCallStream", "ToolCall", "ToolParser",
           "get_tool_parser"]

_GLM = "GLM-4.6 chat template; vLLM glm45/glm47 parsers (vLLM serves GLM-5/5.1 with glm47)"
#: name -> parser; the ``--tool-call-parser`` choices, named as vLLM names the same formats.
TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    ToolParser("hermes", HermesToolCallStream, "Qwen3 chat template; vLLM hermes parser"),
    ToolParser("glm45", Glm45ToolCallStream, _GLM),
    ToolParser("glm47", Glm45ToolCallStream, _GLM),
    ToolParser("deepseek_v31", DeepSeekV31ToolCallStream, "DeepSeek-V3.1 chat template; vLLM deepseek_v31 parser"),
    ToolParser("deepseek_v32", DeepSeekV32ToolCallStream,
               "vLLM deepseek_v32 parser; DeepSeek-V3.2 template port in llama.cpp"),
)}


def get_tool_parser(name: str) -> ToolParser:
    """The registered parser called ``name``.

    Raises:
        ConfigError: no parser has that name (the message lists the names).
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ConfigError(f"unknown tool-call parser {name!r}; choose one of: {', '.join(TOOL_PARSERS)}") from None
