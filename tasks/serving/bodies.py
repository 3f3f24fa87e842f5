"""Request bodies read within --max-body-size (a 413 past it) and decoded off the event loop, and JSON responses
encoded off it: the event loop only moves bytes (tasks/serving/app.py)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from tasks.serving.requests import ApiError, type_name


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size} bytes, more than this server reads ({limit:,} bytes, "
        f"--max-body-size); send a smaller request (split a prompt array over several requests), "
        f"or start the server with a larger --max-body-size",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (413 past it): a larger Content-Length is refused before anything is kept,
    and a chunked body (or one longer than it said) once it passes the limit. What a refused body still sends is read
    and dropped (nothing kept) before the answer, so that a client that sends its whole body before reading the
    response (urllib, requests) gets the 413 rather than a connection reset; a client that asked `Expect:
    100-continue` (curl) gets the 413 at once and sends nothing."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        if request.headers.get("expect", "").lower() != "100-continue":
            async for _ in request.stream():
                pass
        raise _too_large(f"{int(declared):,}", limit)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n <= limit:
            chunks.append(chunk)
    if n > limit:
        raise _too_large(f"{n:,}", limit)
    return b"".join(chunks)


async def respond(content: Any) -> JSONResponse:
    """A JSON response encoded in a worker thread (a dict returned by a route is walked by FastAPI's
    jsonable_encoder on the event loop: seconds for /tokenize's million ids)."""
    return await run_in_threadpool(JSONResponse, content)


MAX_JSON_DEPTH = 32
"""How deeply a request body may nest arrays and objects. The deepest valid body is a chat request whose message
content is a list of parts, or a prompt that is a list of token-id lists: 4 or 5 levels. Past Python's own limit
(~1,000 levels) json.loads raises RecursionError; below it, a deep body would still recurse through validation."""


def json_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests lists and dicts (a scalar: 0), level by level without recursion, stopping past
    `limit`: O(the values in the levels it reads)."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [x for x in level if isinstance(x, (list, dict))]
        if not containers:
            return depth
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]
    return depth


def decode_json(raw: bytes) -> Any:
    """A body's bytes as a JSON object; ApiError 400 for anything else (a body nesting past MAX_JSON_DEPTH too)."""
    deep = ApiError(
        400,
        f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} levels deep; "
        f"an OpenAI request needs at most 5",
    )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(
            400, f"the request body is not valid JSON ({exc}); send a JSON object with Content-Type: application/json"
        ) from None
    except RecursionError:  # deeper than the decoder's own recursion limit
        raise deep from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type_name(body)}")
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise deep
    return body


async def json_body(request: Request, limit: int) -> Any:
    """The body as a JSON object (decoded in a worker thread), at most `limit` bytes (413 past it)."""
    return await run_in_threadpool(decode_json, await read_body(request, limit))
