"""HTTP errors in OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``): the
:class:`APIError` every route raises, and the translations of what FastAPI / Starlette would answer otherwise
(pydantic schema errors as 400 instead of 422, a body that is not JSON, a body over the size limit as 413, a
compressed body as 415).
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from atomtool.errors import InvalidRequestError
from atomtool.serve.api.protocol import ErrorInfo, ErrorResponse
from atomtool.serve.api.strict_json import BodyNotJSON


class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        # a message quoting client text may hold a lone surrogate, which JSON-as-UTF-8 cannot carry: escape it
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def response(self) -> Response:
        return Response(self.body().model_dump_json(), status_code=self.status, media_type="application/json")


def bad_request(exc: InvalidRequestError) -> APIError:
    """The 400 for an engine-side validation error, naming its ``param``."""
    return APIError(400, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))


def _loc_name(loc: list[Any]) -> str:
    """A pydantic error location as the client wrote it: ``messages[0].role``."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's request-validation errors as one OpenAI 400 (message per error, first top-level param).

    A body that is not JSON, not an object or absent gets one plain sentence (FastAPI would report a
    position as the parameter); an unknown field gets OpenAI's "Unrecognized request argument supplied".
    """
    for e in errors:
        loc = list(e.get("loc", ()))
        if e.get("type") == "json_invalid":
            where = f" at position {loc[1]}" if len(loc) > 1 else ""
            reason = (e.get("ctx") or {}).get("error") or "malformed JSON"
            reason = reason.removesuffix(" at")  # json's "Invalid control character at" + our " at position"
            return APIError(400, f"invalid JSON body: {reason}{where}")
        if loc == ["body"]:  # the body as a whole: form-encoded, a JSON array/string, or missing
            return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
    parts, param = [], None
    for e in errors:
        loc = [x for x in e.get("loc", ()) if x != "body"]
        param = param or (str(loc[0]) if loc else None)  # OpenAI names the top-level parameter
        name = _loc_name(loc) or "body"
        if e.get("type") == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {name}")
            continue
        msg = str(e.get("msg"))
        msg = msg.removeprefix("Value error, ")  # our own validators' messages, without pydantic's prefix
        parts.append(f"{name}: {msg}")
    return APIError(400, "; ".join(parts) or "invalid request", param=param)


def unparsed_body(exc: StarletteHTTPException) -> APIError | None:
    """FastAPI's "There was an error parsing the body" 400 (raised for a body json.loads fails on with an
    error other than JSONDecodeError) as the "invalid JSON body: ..." 400 every other unparsable body
    gets; None for any other HTTPException.

    The cause FastAPI chains: RecursionError (nesting deeper than Python's recursion limit, e.g.
    ``[[[[...]]]]`` a thousand levels) or UnicodeDecodeError (bytes that are not UTF-8/16/32 text).
    """
    if exc.status_code != 400 or exc.detail != "There was an error parsing the body":
        return None
    cause = exc.__cause__
    if isinstance(cause, BodyNotJSON):  # NaN/Infinity, or nesting beyond MAX_JSON_DEPTH (strict_json)
        return APIError(400, f"invalid JSON body: {cause}", param=cause.param)
    if isinstance(cause, RecursionError):
        reason = "nesting too deep (arrays/objects nested more levels than the parser allows)"
    elif isinstance(cause, UnicodeDecodeError):
        reason = f"the body is not UTF-8 text ({cause.reason} at byte {cause.start})"
    else:
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else "malformed JSON"
    return APIError(400, f"invalid JSON body: {reason}")


# ------------------------------------------------------------------------------------- middleware
def _too_large_message(limit: int) -> str:
    return f"request body too large: the limit is {limit} bytes (atomtool serve --max-request-bytes)"


class BodyTooLarge(StarletteHTTPException):
    """Raised by the size-limited ``receive`` once a request body passes the limit (an HTTPException, so
    FastAPI's body parsing passes it on as a 413 instead of "There was an error parsing the body")."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large_message(limit))


def too_large(limit: int) -> APIError:
    """The 413 for a request body over ``limit`` bytes."""
    return APIError(413, _too_large_message(limit), code="request_too_large")


def content_codings(raw_headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The content codings a request says its body is in (every ``Content-Encoding`` header, comma lists
    split, lower-cased), without ``identity`` (no coding)."""
    codings = []
    for name, value in raw_headers:
        if name.lower() == b"content-encoding":
            codings += [c.strip().lower() for c in value.decode("latin-1").split(",")]
    return [c for c in codings if c and c != "identity"]


def unsupported_coding(codings: list[str]) -> Response:
    """The 415 for a compressed request body (RFC 9110 section 15.5.16), with RFC 7694's
    ``Accept-Encoding: identity`` response header telling the client what it may send instead.

    Request bodies are not decompressed, as in vLLM, FastAPI and uvicorn (none decode a request's
    Content-Encoding) and OpenAI's clients never compress requests: supporting gzip would need a streaming
    decoder bounded against zip bombs for no client that uses it, while passing compressed bytes on
    unread would answer with a misleading "not UTF-8" 400, or parse a body that was never compressed.
    """
    named = ", ".join(repr(c) for c in codings)
    err = APIError(415, f"Content-Encoding {named} is not supported: send the request body uncompressed "
                   "(no Content-Encoding header, or 'identity')", code="unsupported_content_encoding")
    response = err.response()
    response.headers["Accept-Encoding"] = "identity"
    return response

