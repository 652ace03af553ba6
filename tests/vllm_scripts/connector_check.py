"""Run with the vLLM virtualenv's python by tests/vllm_backend/test_vllm_connector.py: one vLLM engine
(in process, CPU) with ragcache's connector serves the cases below; prints one JSON object.

argv: model folder, dtype."""

from __future__ import annotations

import json
import logging
import os
import sys


class Records(logging.Handler):
    """The connector's per-request log lines, as data: (policy, supplied, chunk hits)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("request %s: ragcache supplied"):
            _, count, policy, hits, computed = record.args
            self.rows.append({"supplied": count, "policy": policy, "chunk_hits": hits, "computed": computed})


def layout_roundtrip() -> dict:
    """KV written with vLLM's CPU cache op at scattered slots reads back equal (both dtypes)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from engine_sidecar.vllm_backend.connector import CacheLayout, write_block

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        isa = _get_attn_isa(dtype, 128, 64)
        cache = torch.zeros(4, 3, 128, 128, dtype=dtype)
        slots = torch.tensor([5, 130, 131, 300, 511, 0])
        keys, values = torch.randn(6, 3, 64).to(dtype), torch.randn(6, 3, 64).to(dtype)
        write_block(cache, keys, values, slots, isa)
        read_k, read_v = CacheLayout(3, 128, 64, dtype, isa).read(cache, slots)
        out[str(dtype)] = {"isa": isa, "equal": bool(torch.equal(read_k, keys) and torch.equal(read_v, values))}
    return out


def main() -> None:
    model_dir, dtype = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the connector's log lines in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from engine_sidecar.request.prompt import PromptBuilder
    from engine_sidecar.vllm_backend.params import connector_config, request_params
    from ragcache_integrations.types import Chunk, ChunkedPrompt

    records = Records()
    logger = logging.getLogger("ragcache.vllm")
    logger.addHandler(records)
    logger.addHandler(logging.StreamHandler())  # the connector's warnings and errors, for a failing test
    logger.setLevel(logging.INFO)
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=4096, enable_prefix_caching=True,
              kv_transfer_config=KVTransferConfig(**connector_config(0.5)))
    builder = PromptBuilder.load(model_dir)
    texts = {
        "lyon": "Lyon is the third-largest city of France, at the confluence of the Rhone and the Saone. " * 6,
        "bread": "Sourdough bread rises with wild yeast and lactic acid bacteria kept in a starter. " * 6,
        "moon": "The Moon is Earth's only natural satellite; its far side was first photographed in 1959. " * 6,
    }

    def prompt(order: list[str], question: str) -> ChunkedPrompt:
        return ChunkedPrompt(chunks=[Chunk(text=texts[c], id=c) for c in order], question=question)

    def run(p: ChunkedPrompt, salt: str, policy: str | None, tenant: str = "", supply: str = "hits") -> dict:
        ids = builder.build(p).token_ids
        extra = {"kv_transfer_params": request_params(p, policy, tenant, supply)} if policy else None
        sampling = SamplingParams(max_tokens=12, temperature=0.0, extra_args=extra)
        before = len(records.rows)
        out = llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, sampling, use_tqdm=False)[0]
        return {"prompt_tokens": len(ids), "cached": out.num_cached_tokens or 0,
                "tokens": list(out.outputs[0].token_ids), "connector": records.rows[before:],
                "stats": (out.kv_transfer_params or {}).get("ragcache")}

    first = prompt(["lyon", "bread", "moon"], "Where do the two rivers meet?")
    again = prompt(["moon", "lyon", "bread"], "What rises sourdough bread?")
    results = {
        "native": run(first, "native", None),
        # nothing stored yet: vLLM computes the prompt, ragcache learns its chunks from vLLM's cache
        "learn": run(first, "learn", "cacheblend"),
        # now stored: ragcache supplies the leading chunks (full prefill), vLLM the rest
        "full": run(first, "full", "full"),
        "fused_again": run(again, "fusion", "cacheblend"),
        "native_again": run(again, "native2", None),
        "tenant_a": run(again, "tenant-a", "cacheblend", "team-a"),
        "tenant_a_again": run(again, "tenant-a2", "cacheblend", "team-a"),
        "tenant_b": run(again, "tenant-b", "cacheblend", "team-b"),
        "no_params": run(first, "plain", None),
        # supply="all": nothing stored for this tenant, yet ragcache supplies every chunk (computed
        # in place) and vLLM computes only the question; then the same chunks again, fused
        "all_cold": run(first, "all-cold", "cacheblend", "team-all", "all"),
        "all_again": run(again, "all-again", "cacheblend", "team-all", "all"),
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "layout": layout_roundtrip(),
    }
    from engine_sidecar.vllm_backend.connector import check_vllm_version

    try:
        check_vllm_version("0.31.2")
        results["version_error"] = None
    except RuntimeError as exc:
        results["version_error"] = str(exc)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
