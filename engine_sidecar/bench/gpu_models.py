"""`ragcache bench gpu`'s models: Llama shapes with random weights made on the device (speed does not
depend on weight values), saved as real model folders, transformers' reference, and the prompts' passages."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Llama shapes (hidden, intermediate, layers, heads, kv heads, head dim), as in their configs
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}
ROPE = {"rope_theta": 500000.0, "rope_type": "default"}
QUESTION = "Which of the passages above names the person who founded the company, and in what year?"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "musique_s.json"


# --- models with random weights ----------------------------------------------------------------------
def model_folder(shape: dict[str, Any], tokenizer_dir: Path, out: Path, vocab_size: int = 49152) -> Path:
    """A model folder holding the tokenizer and a Llama config of `shape` (no weights: they are made
    on the device by `random_runner`). The placeholder weights file keeps the fingerprints honest."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "rope_parameters": ROPE, "bos_token_id": 1, "eos_token_id": 2, **shape}
    (out / "config.json").write_text(json.dumps(config))
    save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))
    return out


def random_runner(model_dir: Path, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A ModelRunner of the folder's shape with random weights made on the device (an 8B shape
    never touches the host)."""
    from engine_sidecar.model.families import load_config
    from engine_sidecar.model.layers import DecoderLayer, Projections, RMSNorm
    from engine_sidecar.model.runner import ModelRunner
    from engine_sidecar.model.weights import ModelWeights

    c = load_config(model_dir)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=device, generator=gen) * 0.02).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    eps = c.rms_norm_eps
    layers = [DecoderLayer(RMSNorm(ones(c.hidden_size), eps),
                           Projections(rand(q + 2 * kv, c.hidden_size), None, rand(c.hidden_size, q), c.num_heads,
                                       c.num_kv_heads, c.head_dim),
                           RMSNorm(ones(c.hidden_size), eps), rand(2 * c.intermediate_size, c.hidden_size),
                           rand(c.hidden_size, c.intermediate_size)) for _ in range(c.num_layers)]
    weights = ModelWeights(rand(c.vocab_size, c.hidden_size), layers, RMSNorm(ones(c.hidden_size), eps),
                           rand(c.vocab_size, c.hidden_size))
    return ModelRunner(c, weights, dtype, device)


def engine_on(runner, model_dir: Path, **options):
    from engine_sidecar.engine.engine import Engine
    from engine_sidecar.engine_config import EngineConfig

    config = EngineConfig.from_options(model=str(model_dir), device=runner.device.type,
                                       dtype=str(runner.dtype).removeprefix("torch."), disk=False, **options)
    return Engine.from_runner(runner, model_dir, config)


def hf_reference(shape: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """transformers' Llama of the same shape (random init, sdpa attention): the full-prefill peer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=32768,
                         tie_word_embeddings=False, rope_parameters=ROPE, attn_implementation="sdpa", **shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)


def param_bytes(shape: dict[str, Any], dtype: torch.dtype, vocab: int = 49152) -> int:
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return (n * per_layer + 2 * vocab * h + h) * torch.empty((), dtype=dtype).element_size()


def prefill_flops(shape: dict[str, Any], tokens: int, vocab: int = 49152) -> float:
    """Matmul FLOPs of a causal prefill: 2 x params x tokens, plus QK^T and PV over the causal half,
    plus the last token's lm_head."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    dense = 2 * tokens * n * (h * (q + 2 * kv) + q * h + 3 * h * i)
    attention = n * 2 * 2 * q * tokens * tokens / 2
    return dense + attention + 2 * vocab * h


# --- passages ---------------------------------------------------------------------------------------
def passages(count: int, tokens: int, encode: Callable[[str], list[int]], data: Path | None) -> list[str]:
    """`count` passages of about `tokens` tokens each, joined from a QA set's passages (the bundled
    sample's when neither `data` nor ../shared/data is there)."""
    from engine_sidecar.bench.stream import corpus_texts

    texts, source = corpus_texts(data or (SHARED_DATA if SHARED_DATA.is_file() else None))
    texts = [t for t in texts if len(t.split()) > 20]
    if not texts:
        raise ValueError(f"{source}: no passages to build prompts from")
    out, i = [], 0
    while len(out) < count:
        parts: list[str] = []
        while len(encode(" ".join(parts))) < tokens:
            parts.append(texts[i % len(texts)])
            i += 1
        words = " ".join(parts).split()
        while len(encode(" ".join(words))) > tokens and len(words) > 1:  # trim back to the length
            words = words[: max(1, int(len(words) * 0.95))]
        out.append(" ".join(words) + f" (passage {len(out)})")
    return out
