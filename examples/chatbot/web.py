"""The sample chatbot's web page: a question box, the answer streamed as it is generated, the
retrieved sources, and per-turn numbers with a chart of TTFT vs full prefill.

    python -m examples.chatbot.web                 # starts a sidecar, ingests if needed, prints the URL
    python -m examples.chatbot.web --base-url http://127.0.0.1:8808   # use a running sidecar

API: GET / (the page), GET /api/info, POST /api/chat {"conversation_id", "question"} answering
with server-sent events: `sources`, `delta` (repeated), `stats`, or `error`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fastapi import FastAPI  # noqa: E402
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from examples.chatbot.service import CONVERSATION_ID, ChatService, ChatSettings  # noqa: E402
from ragcache_integrations.policy_registry import DEFAULT_POLICY, forms_text, policy_arg  # noqa: E402

PAGE = Path(__file__).with_name("static") / "index.html"


class ChatRequest(BaseModel):
    conversation_id: str = Field(pattern=CONVERSATION_ID.pattern)
    question: str = Field(min_length=1, max_length=4000)


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def create_app(service: ChatService) -> FastAPI:
    app = FastAPI(title="ragcache sample chatbot")

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text(encoding="utf-8")

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        return service.describe()

    @app.post("/api/chat")
    async def chat(request: ChatRequest) -> StreamingResponse:
        if not request.question.strip():
            return JSONResponse({"error": "the question is empty"}, status_code=400)  # type: ignore[return-value]

        async def events() -> AsyncIterator[str]:
            try:
                async for event in service.turn(request.conversation_id, request.question):
                    yield sse(event.pop("type"), event)
            except Exception as exc:  # shown in the page instead of a silently broken stream
                yield sse("error", {"message": f"{type(exc).__name__}: {exc}"})

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket bound before uvicorn starts, so port 0 can print the real port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"chatbot: error: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.chatbot.web", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address of the page (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8800, help="port of the page (default 8800; 0 = any free port)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None, help="a running `ragcache serve` sidecar (default: start one)")
    where.add_argument("--in-process", action="store_true", help="run the engine inside this process instead")
    p.add_argument("--model", default="default", help="model of the sidecar this starts (default: SmolLM2)")
    p.add_argument("--sidecar-arg", action="append", default=[],
                   help="extra flag for the sidecar this starts, e.g. --sidecar-arg=--no-disk (repeatable)")
    p.add_argument("--qdrant-path", type=Path, default=None, help="Qdrant local-mode folder "
                   "(default: $RAGCACHE_HOME/qdrant)")
    p.add_argument("--qdrant-url", default=None, help="a Qdrant server instead of local mode")
    p.add_argument("--no-ingest", action="store_true", help="do not ingest the default corpus when the "
                   "collection is empty")
    p.add_argument("--k", type=int, default=3, help="passages retrieved per question (default 3)")
    p.add_argument("--policy", default=DEFAULT_POLICY, type=policy_arg, help=f"ragcache policy: {forms_text()} (default {DEFAULT_POLICY})")
    p.add_argument("--max-tokens", type=int, default=64, help="answer length limit (default 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from engine_sidecar.server.process import SidecarError, SidecarProcess
    from examples.chatbot.ingest import embedder, ensure_ingested, open_qdrant

    args = build_parser().parse_args(argv)
    # uvicorn re-raises SIGTERM after its graceful shutdown; as SystemExit, the `finally` below
    # still stops the sidecar this started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.k < 1 or args.max_tokens < 1:
        raise SystemExit("chatbot: error: --k and --max-tokens must be at least 1")
    sock = bind(args.host, args.port)
    client = open_qdrant(args.qdrant_path, args.qdrant_url)
    sidecar: SidecarProcess | None = None
    engine = None
    try:
        model = embedder()
        if not args.no_ingest:
            ensure_ingested(client, model)
        if args.base_url:
            backend: dict[str, Any] = {"base_url": args.base_url}
        elif args.in_process:
            from engine_sidecar import Engine

            engine = Engine.from_pretrained(args.model, device="cpu")
            backend = {"engine": engine}
        else:
            log = Path(tempfile.mkdtemp(prefix="ragcache-chatbot-")) / "sidecar.log"
            print(f"starting the sidecar (log: {log}) ...", flush=True)
            try:
                sidecar = SidecarProcess(log, "--model", args.model, *args.sidecar_arg).start()
            except SidecarError as exc:
                raise SystemExit(f"chatbot: error: {exc}") from None
            backend = {"base_url": sidecar.base}
        try:
            service = ChatService(client, model, backend,
                                  ChatSettings(k=args.k, policy=args.policy, max_tokens=args.max_tokens))
        except ValueError as exc:
            raise SystemExit(f"chatbot: error: {exc}") from None
        try:
            cost = service.measure_full_prefill()
        except Exception as exc:  # the first request to the engine: an unreachable sidecar shows here
            raise SystemExit(f"chatbot: error: the engine did not answer ({type(exc).__name__}: {exc}); "
                             "check --base-url and that `ragcache serve` is running") from None
        print(f"full prefill measured: {cost.tokens[0]} tokens in {cost.ttft_s[0]:.2f}s, {cost.tokens[1]} in "
              f"{cost.ttft_s[1]:.2f}s (the page's full-prefill bars follow the curve through both)", flush=True)
        host, port = sock.getsockname()[:2]
        print(f"ragcache chatbot on http://{host}:{port}/  (sidecar: {backend.get('base_url', 'in-process')}; "
              "Ctrl-C stops)", flush=True)
        config = uvicorn.Config(create_app(service), log_level="warning")
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
        if engine is not None:
            engine.close()
        if sidecar is not None:
            sidecar.stop()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
