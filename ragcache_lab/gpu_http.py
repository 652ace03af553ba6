"""`ragcache bench gpu`'s HTTP section: the sidecar's own app (FastAPI under uvicorn, in this
process, on a loopback port) around a random-weights engine, with closed-loop clients streaming
`/v1/generate` over httpx, as a chatbot's backend would. Each request asks `--http-passages`
stored passages in an order of its own with a question of its own and decodes
`--decode-tokens` tokens past EOS; per concurrency: TTFT p50/p99 (arrival to first streamed text)
and output tokens/s over the level's wall time. Needs the server extra (fastapi, uvicorn); where
they are missing the section says so and the others run."""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ragcache_lab.gpu_models import SHAPES, engine_on, model_folder, passages, random_runner

MISSING_SERVER = "needs the server extra (fastapi, uvicorn; on a machine without network, carry their wheels: " \
                 "docs/deployment.md)"


def server_missing() -> str | None:
    """Why the app cannot be served here (the server extra is not installed), else None."""
    try:
        import uvicorn  # noqa: F401

        from engine_sidecar.server.app import create_app  # noqa: F401
    except ImportError as exc:
        return f"{MISSING_SERVER}: {exc}"
    return None


@contextlib.contextmanager
def random_engine(name: str, device: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path,
                  args: argparse.Namespace, max_batch: int, kv_rows: int | None = None,
                  kv_block_size: int = 0) -> Iterator[Any]:
    """An engine of shape `name` with random weights, batching up to `max_batch` requests (the
    served sections' clients must not queue behind a smaller batch) and, with `kv_rows`, admitting
    running requests up to that many KV rows together (see `kv_budget`; with `kv_block_size`, a
    block pool of those bytes); closed, and its device memory given back, on exit."""
    folder = model_folder(SHAPES[name], tokenizer_dir, work / f"model-{name}")
    runner = random_runner(folder, device, dtype)
    options: dict[str, int] = {"batch_kv_bytes": kv_budget(runner, kv_rows)} if kv_rows else {}
    if kv_block_size:
        options["kv_block_size"] = kv_block_size
    engine = engine_on(runner, folder, ram_cache_bytes=args.ram_bytes, max_batch=max(max_batch, 1), **options)
    try:
        yield engine
    finally:
        engine.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def kv_row_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's KV as a running request holds it: keys before and after RoPE and values,
    every layer (the engine's KV buffer)."""
    return 3 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget(runner: Any, rows: int) -> int:
    """Bytes of `rows` KV rows, so admission is not what limits a level; on a GPU at most half the
    memory the weights left free, so the chunk store and the activations keep room."""
    c = runner.config
    need = rows * kv_row_bytes(c.num_layers, c.num_kv_heads, c.head_dim, runner.dtype)
    if runner.device.type == "cuda":
        need = min(need, torch.cuda.mem_get_info(runner.device)[0] // 2)
    return max(need, 1 << 20)


def http_section(name: str, device: torch.device, dtype: torch.dtype, tokenizer_dir: Path, work: Path,
                 args: argparse.Namespace) -> dict[str, Any]:
    missing = server_missing()
    if missing:
        return {"skipped": missing}
    from ragcache_lab.closed_loop import ChatRequest, RagcacheTarget, run_level

    clients_max = max(args.http_clients)
    out: dict[str, Any] = {"tokens_each": args.decode_tokens, "passages": args.http_passages,
                           "passage_tokens": args.http_passage_tokens, "policy": args.http_policy}
    with random_engine(name, device, dtype, tokenizer_dir, work, args, clients_max) as engine:
        stored = passages(args.http_passages, args.http_passage_tokens,
                          lambda t: engine.tokenizer().encode(t), args.data)
        engine.warm(stored)
        rng = random.Random(0)

        def requests(count: int, tag: str) -> list[ChatRequest]:
            # the stored passages in an order of each request's own (no exact prefix), a new question
            return [ChatRequest(f"Which passage names the founder? ({tag} {i})", tuple(rng.sample(stored, len(stored))))
                    for i in range(count)]

        with serving(engine, max_queue=clients_max + 4) as base:
            target = RagcacheTarget(base, args.decode_tokens, args.http_policy, ignore_eos=True)
            run_level("warm-up", target, requests(2, "warm-up"), 1)  # first-request costs off the clock
            for clients in args.http_clients:
                level = run_level("ragcache", target, requests(clients * args.http_requests, str(clients)), clients)
                summary = level.summary()
                out[str(clients)] = {key: (round(v, 4) if isinstance(v, float) else v) for key, v in summary.items()
                                     if key in ("requests", "errors", "first_errors", "ttft_p50_s", "ttft_p99_s",
                                                "output_tokens", "wall_s", "output_tokens_per_s")}
    return out


@contextlib.contextmanager
def serving(engine: Any, max_queue: int) -> Iterator[str]:
    """The sidecar's app around `engine` under uvicorn on a free loopback port, in a thread; yields
    its base URL and stops the server on exit (the engine stays the caller's)."""
    import uvicorn

    from engine_sidecar.server.app import create_app
    from engine_sidecar.server.settings import ServerSettings

    settings = ServerSettings(max_queue=max_queue)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, settings), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="bench-gpu-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the sidecar did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
