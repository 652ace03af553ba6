"""Server-sent events framing and the response that carries them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel


def sse(data: BaseModel | dict[str, Any] | str, event: str | None = None) -> str:
    if isinstance(data, BaseModel):
        payload = data.model_dump_json()
    elif isinstance(data, dict):
        payload = json.dumps(data)
    else:
        payload = data
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache and no proxy buffering: each token must reach the client when it is made
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
