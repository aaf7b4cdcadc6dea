"""Request bodies parsed as strict JSON (RFC 8259), with a bound on nesting depth.

Python's ``json.loads`` (what Starlette's ``Request.json`` calls) accepts ``NaN``, ``Infinity`` and
``-Infinity``, which are not JSON: a body holding them is refused here, so ``"temperature": NaN`` is
"invalid JSON body", never a range error about a value the client did not mean to send. It also accepts
nesting up to the interpreter's recursion limit (~1000 levels), while everything after parsing (validation,
the Unicode check, chat-template rendering, ``json.dumps`` of tool schemas) recurses too and would fail on a
body only a few levels shallower than that: nesting beyond :data:`MAX_JSON_DEPTH` is refused up front,
naming the field where it happens. An object key holding a lone UTF-16 surrogate (``{"\\ud800": 1}``: JSON
lets a ``\\u`` escape name half a pair, but such a key is not Unicode text) is refused here too, naming the
object it is in: validation would otherwise report it as "not a JSON object" (the top level) or as a string
"unable to parse raw data" (inside a message). Lone surrogates in string *values* are the app's
``check_unicode`` 400, which names the field.

FastAPI reads the body through ``Request.json()``; :class:`StrictJSONRoute` (FastAPI's documented
custom-``APIRoute`` hook) hands each endpoint a :class:`StrictJSONRequest` instead. Errors raised here reach
the app as FastAPI's "There was an error parsing the body" 400 with this :class:`BodyNotJSON` as its cause,
which the app turns into "invalid JSON body: <message>".
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

#: deepest nesting of arrays/objects a request body may have (the top-level object is level 1). Tool
#: parameter schemas and chat_template_kwargs nest a handful of levels; this leaves room for any real
#: one and keeps every recursive step after parsing far from Python's recursion limit.
MAX_JSON_DEPTH = 100


class BodyNotJSON(ValueError):
    """The body is not strict JSON or nests too deeply; ``param`` is the top-level field at fault, if known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _reject_constant(name: str) -> Any:
    raise BodyNotJSON(f"{name} is not valid JSON (JSON has no NaN or Infinity; send a finite number)")


#: longest integer literal accepted: Python's own int-from-text limit (sys.get_int_max_str_digits default)
MAX_INT_DIGITS = 4300


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyNotJSON(f"an integer with {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _path_text(link: tuple | None) -> str:
    """``('a', (0, ('tools', None)))`` -> ``tools[0].a``."""
    parts = []
    while link is not None:
        key, link = link
        parts.append(key)
    out = ""
    for key in reversed(parts):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a parsed JSON value nested more than ``limit`` arrays/objects deep (iterative: no recursion).

    Raises:
        BodyNotJSON: names the path where the limit is passed (the first 8 levels, then ``...``).
    """
    stack: list[tuple[Any, int, tuple | None]] = [(value, 1, None)]
    while stack:
        node, depth, link = stack.pop()
        if depth > limit:
            shown = link
            hops = 0
            while shown is not None and hops < depth - 9:  # keep the outermost 8 keys
                shown = shown[1]
                hops += 1
            path = _path_text(shown) + ("..." if hops else "")
            top = _path_text(_outermost(link))
            raise BodyNotJSON(f"{path or 'the body'}: nested more than {limit} levels deep (the server's limit "
                              "for arrays/objects in a request)", param=top or None)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if child.__class__ is dict or child.__class__ is list:
                stack.append((child, depth + 1, (key, link)))


def surrogate_problem(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (the first lone UTF-16 surrogate in it, which UTF-8 cannot encode),
    or None; e.g. ``lone surrogate \\ud800 at character 0``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"lone surrogate \\u{ord(text[exc.start]):04x} at character {exc.start}"
    return None


def check_keys(value: Any) -> None:
    """Refuse a parsed JSON value with an object key that is not valid Unicode (iterative: no recursion).

    Raises:
        BodyNotJSON: names the object holding the key (``messages[0]: the object key '\\ud800'``, or ``the
            top-level key '\\ud800'``) and the surrogate; ``param`` is the top-level field it is under (None
            for a top-level key).
    """
    stack: list[tuple[Any, tuple | None]] = [(value, None)]
    while stack:
        node, link = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            problem = surrogate_problem(key) if isinstance(key, str) else None
            if problem is not None:
                shown = repr(key if len(key) <= 40 else key[:40] + "...")  # repr escapes the surrogate
                where = f"{_path_text(link)}: the object key" if link else "the top-level key"
                raise BodyNotJSON(f"{where} {shown} is not valid Unicode: {problem} (an unpaired \\u escape; "
                                  "send well-formed UTF-16 pairs)", param=_path_text(_outermost(link)) or None)
            if child.__class__ is dict or child.__class__ is list:
                stack.append((child, (key, link)))


#: What may hold a lone surrogate in a UTF-8 body: a ``\\uD800``-``\\uDFFF`` escape, or the three-byte UTF-8
#: form of a surrogate (invalid UTF-8, yet json.loads decodes bytes with ``surrogatepass``).
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")


def _may_hold_surrogate(raw: bytes) -> bool:
    """Whether a body could decode to text holding a lone surrogate (a fast scan at C speed; UTF-16/32
    bodies, which can carry one without an escape, always could)."""
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        return True
    return _MAYBE_SURROGATE.search(raw) is not None


def _outermost(link: tuple | None) -> tuple | None:
    """The path link of the top-level key only."""
    while link is not None and link[1] is not None:
        link = link[1]
    return link


def loads_strict(body: bytes | str) -> Any:
    """``json.loads`` that refuses NaN/Infinity, nesting deeper than :data:`MAX_JSON_DEPTH` and object keys
    holding a lone surrogate.

    Raises:
        json.JSONDecodeError: malformed JSON (as ``json.loads``).
        BodyNotJSON: a NaN/Infinity constant, an integer longer than :data:`MAX_INT_DIGITS` digits, nesting
            too deep (names the field), or an object key that is not valid Unicode (:func:`check_keys`).
    """
    value = json.loads(body, parse_constant=_reject_constant, parse_int=_parse_int)
    raw = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
    # fast path (C speed): a body with at most `limit` brackets cannot nest deeper than that
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and isinstance(value, dict | list):
        check_depth(value)
    if isinstance(value, dict | list) and _may_hold_surrogate(raw):
        check_keys(value)
    return value


class StrictJSONRequest(Request):
    """A Starlette request whose ``json()`` is :func:`loads_strict`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads_strict(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose endpoints receive a :class:`StrictJSONRequest` (set as ``router.route_class``)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Any:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
