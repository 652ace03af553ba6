"""`ragcache bench gpu`'s models: shapes of each family with random weights made on the device (speed does not
depend on weight values), saved as real model folders, transformers' reference, and the prompts' passages."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Model shapes as in their configs; `model_type` picks the family (Llama where absent), the rest is
# that family's config.json fields
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          rope_theta=1000000.0),
    "gemma3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                       query_pre_attn_scalar=256, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       tie_word_embeddings=True),
}
# each family's shape for the guards against transformers (small: the reference runs on the host)
GUARD_SHAPES: dict[str, dict[str, Any]] = {
    "llama": SHAPES["small"],
    "qwen3": dict(SHAPES["small"], model_type="qwen3"),
    "qwen3_moe": dict(SHAPES["small"], model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=256, norm_topk_prob=True),
    "gemma3_text": dict(SHAPES["small"], model_type="gemma3_text", sliding_window=64, query_pre_attn_scalar=64,
                        tie_word_embeddings=True),
}
ROPE = {"rope_theta": 500000.0, "rope_type": "default"}
QUESTION = "Which of the passages above names the person who founded the company, and in what year?"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "musique_s.json"
VOCAB = 49152  # the tokenizer's (SmolLM2's): every shape shares it


# --- models with random weights ----------------------------------------------------------------------
def hf_config(shape: dict[str, Any], vocab_size: int = VOCAB):
    """transformers' config of this shape (its family's class)."""
    from transformers import AutoConfig

    fields = dict(shape)
    model_type = fields.pop("model_type", "llama")
    if model_type == "llama":
        fields.setdefault("rope_parameters", ROPE)
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, rms_norm_eps=1e-5, max_position_embeddings=32768,
                                tie_word_embeddings=fields.pop("tie_word_embeddings", False), bos_token_id=1,
                                eos_token_id=2, pad_token_id=0, **fields)


def model_folder(shape: dict[str, Any], tokenizer_dir: Path, out: Path, vocab_size: int = VOCAB) -> Path:
    """A model folder holding the tokenizer and the config of `shape` (no weights: they are made
    on the device by `random_runner`). The placeholder weights file keeps the fingerprints honest."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    hf_config(shape, vocab_size).save_pretrained(str(out))
    save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))
    return out


def parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and size in transformers' model of this config (made on the meta
    device: no memory); a tied output layer is the embedding's, not a tensor of its own."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        sizes.pop("lm_head.weight", None)
    return sizes


def random_runner(model_dir: Path, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A ModelRunner of the folder's shape with random weights made on the device (an 8B shape
    never touches the host), loaded by the family's own code as a checkpoint would be."""
    from transformers import AutoConfig

    from engine_sidecar.model.families import load_config, load_weights
    from engine_sidecar.model.runner import ModelRunner

    c = load_config(model_dir)
    gen = torch.Generator(device=device).manual_seed(seed)
    neutral = 0.0 if c.model_type.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    named: dict[str, torch.Tensor] = {}
    for name, size in parameter_shapes(AutoConfig.from_pretrained(str(model_dir))).items():
        if "norm" in name:
            named[name] = torch.full(size, neutral, device=device, dtype=dtype)
        else:
            named[name] = (torch.randn(*size, device=device, generator=gen) * 0.02).to(dtype)
    return ModelRunner(c, load_weights(model_dir, c, dtype, device, named), dtype, device)


def engine_on(runner, model_dir: Path, **options):
    from engine_sidecar.engine.engine import Engine
    from engine_sidecar.engine_config import EngineConfig

    config = EngineConfig.from_options(model=str(model_dir), device=runner.device.type,
                                       dtype=str(runner.dtype).removeprefix("torch."), disk=False, **options)
    return Engine.from_runner(runner, model_dir, config)


def hf_reference(shape: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """transformers' model of the same shape (random init, sdpa attention): the full-prefill peer."""
    from transformers import AutoModelForCausalLM

    config = hf_config(shape)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(previous)


def _active_parameters(shape: dict[str, Any]) -> tuple[int, int]:
    """(all parameters, those one token reads: a routed expert counted k / E of the time)."""
    sizes = parameter_shapes(hf_config(shape))
    total = active = 0
    experts, chosen = shape.get("num_experts", 0), shape.get("num_experts_per_tok", 0)
    for name, size in sizes.items():
        count = 1
        for d in size:
            count *= d
        total += count
        active += count * chosen // experts if experts and ".experts." in name else count
    return total, active


def param_bytes(shape: dict[str, Any], dtype: torch.dtype, vocab: int = VOCAB) -> int:
    return _active_parameters(shape)[1] * torch.empty((), dtype=dtype).element_size()


def prefill_flops(shape: dict[str, Any], tokens: int, vocab: int = VOCAB) -> float:
    """Matmul FLOPs of a causal prefill: 2 x the parameters a token reads (less the embeddings)
    x tokens, plus QK^T and PV over the causal half, plus the last token's lm_head."""
    h, n = shape["hidden_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    per_token = _active_parameters(shape)[1] - 2 * vocab * h  # embeddings and lm_head: a lookup, one row
    attention = n * 2 * 2 * q * tokens * tokens / 2
    return 2 * tokens * per_token + attention + 2 * vocab * h


# --- passages ---------------------------------------------------------------------------------------
def passages(count: int, tokens: int, encode: Callable[[str], list[int]], data: Path | None) -> list[str]:
    """`count` passages of about `tokens` tokens each, joined from a QA set's passages (the bundled
    sample's when neither `data` nor ../shared/data is there)."""
    from ragcache_lab.stream import corpus_texts

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
