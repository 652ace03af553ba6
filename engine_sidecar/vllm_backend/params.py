"""What a request tells ragcache's vLLM connector, and how many prompt tokens it may supply.

A request carries its chunk structure in vLLM's per-request `kv_transfer_params` under the key
`ragcache`; its prompt must be exactly the token ids ragcache lays out for that structure (the
connector checks, and supplies nothing for a prompt that differs)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragcache_integrations.types import ChunkedPrompt

PARAMS_KEY = "ragcache"
MODULE_PATH = "engine_sidecar.vllm_backend.connector"


class ConnectorParams(BaseModel):
    """`kv_transfer_params["ragcache"]` of one vLLM request."""

    model_config = ConfigDict(extra="forbid")

    prompt: ChunkedPrompt
    policy: str = Field("cacheblend", description="ragcache fusion policy for the supplied KV")
    tenant: str = Field("", description="ragcache tenant; map it to vLLM's cache_salt as well")
    supply: Literal["hits", "all"] = Field(
        "hits", description="hits: ragcache supplies the leading run of chunks it holds, vLLM computes from the first "
                            "new chunk on; all: ragcache supplies every chunk, computing new ones in place (put them "
                            "first), and vLLM computes only the question")


def connector_params(kv_transfer_params: dict[str, Any] | None) -> ConnectorParams | None:
    """The request's ragcache params, or None when it has none (a plain vLLM request)."""
    if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
        return None
    return ConnectorParams.model_validate(kv_transfer_params[PARAMS_KEY])


def request_params(prompt: ChunkedPrompt, policy: str = "cacheblend", tenant: str = "",
                   supply: Literal["hits", "all"] = "hits") -> dict[str, Any]:
    """The `kv_transfer_params` value a client sends with the prompt's token ids."""
    params = ConnectorParams(prompt=prompt, policy=policy, tenant=tenant, supply=supply)
    return {PARAMS_KEY: params.model_dump(mode="json")}


def claimable_tokens(prompt_tokens: int, computed_tokens: int, block_size: int, limit: int | None = None) -> int:
    """Tokens the connector supplies beyond the `computed_tokens` vLLM already holds, up to
    position `limit` (default: the whole prompt): whole blocks only (vLLM allocates and caches KV
    by block), and never the last prompt token, whose forward pass vLLM needs for the first
    token's logits."""
    end = prompt_tokens - 1 if limit is None else min(limit, prompt_tokens - 1)
    return max(0, end // block_size * block_size - computed_tokens)


def leading_resident_end(segments: list[tuple[str, str, int]], resident: set[str]) -> int:
    """End position of the prompt's leading run of stored chunks: `segments` are (kind, residency
    key, length) in prompt order; the template prefix before them and each passage's first and last
    words between them count with them (ragcache computes or keeps those), the run stops at the first chunk not resident or at the question."""
    end = position = 0
    for kind, key, length in segments:
        position += length
        if kind in ("prefix", "separator"):  # ragcache computes them with the chunks around them
            continue
        if kind != "chunk" or key not in resident:
            break
        end = position
    return end


def chunks_end(segments: list[tuple[str, str, int]]) -> int:
    """End position of the prompt's last chunk (`segments` as for `leading_resident_end`): what
    `supply="all"` claims up to, stored or not; 0 without chunks."""
    end = position = 0
    for kind, _, length in segments:
        position += length
        if kind == "chunk":
            end = position
    return end


def slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """vLLM's cache slots of token positions [start, end) of a request holding `block_ids`."""
    return [block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


def connector_config(ram_cache_gb: float = 2.0, stats_path: str | None = None,
                     fused_temperature: str | float = "auto") -> dict[str, Any]:
    """The `kv_transfer_config` that loads this connector. `stats_path`: a file the worker appends
    one JSON line of ragcache stats to per request (streamed responses carry no
    `kv_transfer_params`, so a benchmark reads them there). `fused_temperature`: the worker
    engine's setting of that name (docs/configuration.md)."""
    extra: dict[str, Any] = {"ram_cache_gb": ram_cache_gb, "fused_temperature": fused_temperature}
    if stats_path:
        extra["stats_path"] = stats_path
    # a load that fails is recomputed by vLLM (its default fails the request)
    return {"kv_connector": "RagcacheConnector", "kv_role": "kv_both", "kv_connector_module_path": MODULE_PATH,
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
