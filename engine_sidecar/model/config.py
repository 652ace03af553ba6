"""Model hyper-parameters read from a HF `config.json`, for the Llama family only."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_sidecar.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def kv_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 nests theta and scaling in `rope_parameters`; older configs keep them flat.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"no config.json in {model_dir}: give a Hugging Face model folder, or run `ragcache model prepare`"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON ({exc}); re-create the model folder") from exc
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type '{model_type}' in {path} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    window = raw.get("sliding_window") if model_type == "mistral" else None
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_from(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama may declare them with attention_bias.
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        sliding_window=int(window) if window else None,
        eos_token_ids=_eos_ids(raw),
        bos_token_id=raw.get("bos_token_id"),
    )
