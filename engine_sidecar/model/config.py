"""Model hyper-parameters read from a HF `config.json`: what every family shares, and per layer the
attention window and the RoPE table it uses. Which model types are read, and how, is each family's
(`model/families/`); this module holds the plain data they produce."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_sidecar.errors import CorruptModelError, ModelNotFoundError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # LongRoPE: one divisor per rotated frequency (the short factors: prompts up to
    # original_max_position_embeddings), and the constant scale of the rotated q/k dimensions
    ext_factors: tuple[float, ...] | None = None
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts (Qwen3-MoE): each token's MLP is the weighted sum of its top-k experts."""

    num_experts: int
    experts_per_token: int
    expert_size: int  # each expert's intermediate size
    normalize_top_k: bool  # routing weights of the chosen experts renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP instead


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
    rope: RopeConfig  # the RoPE of full-attention layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None  # the window of the layers that have one (None: no layer does)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # per layer: its attention window (None: every earlier token) and which of `ropes` it rotates by
    layer_windows: tuple[int | None, ...] = ()
    layer_ropes: tuple[int, ...] = ()
    ropes: tuple[RopeConfig, ...] = ()
    rotary_dim: int = 0  # the rotated share of head_dim (partial rotary); 0: all of it
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    moe: MoeConfig | None = None
    # what the family's layer needs beyond these (Gemma 3's query scale, a logit cap, ...)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (self.sliding_window,) * self.num_layers)
        if not self.ropes:
            object.__setattr__(self, "ropes", (self.rope,))
        if not self.layer_ropes:
            object.__setattr__(self, "layer_ropes", (0,) * self.num_layers)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def kv_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer attends with the same window and RoPE table (a captured graph's
        tables and a batched decode's key ranges hold one of each)."""
        return len(set(self.layer_windows)) == 1 and len(set(self.layer_ropes)) == 1


def rope_from(params: dict[str, Any], head_dim: int) -> RopeConfig:
    """One RoPE from a `rope_parameters`/`rope_scaling` mapping (theta, type and scaling)."""
    from engine_sidecar.errors import UnsupportedModelError

    theta = float(params.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    short = params.get("short_factor")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or 8192),
        ext_factors=tuple(float(f) for f in short) if rope_type == "longrope" and short else None,
        attention_factor=float(params.get("attention_factor") or 1.0),
    )


def rope_params(raw: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of `raw` (of one layer type, where transformers >= 5 nests them per
    type), with the legacy flat keys filled in: theta and scaling were top-level before."""
    nested = dict(raw.get("rope_parameters") or {})
    if layer_type is not None and isinstance(nested.get(layer_type), dict):
        nested = dict(nested[layer_type])
    elif any(isinstance(v, dict) for v in nested.values()):
        nested = dict(nested.get("full_attention") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **nested}
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" not in params and raw.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return params


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(
            f"no config.json in {model_dir}: give a Hugging Face model folder, or run `ragcache model prepare`"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON ({exc}); re-create the model folder") from exc
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path} is not a JSON object; re-create the model folder")
    return raw
