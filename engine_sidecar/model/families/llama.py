"""The Llama family: Llama 2/3.x and SmolLM2 (llama), Qwen2/2.5 (qwen2), Mistral (mistral) and
Ministral (ministral, sliding and full attention layer by layer). One layer: pre-norm attention
and a SwiGLU MLP (`layers.DecoderLayer`); they differ in biases and in which layers slide."""

from __future__ import annotations

from typing import Any

from engine_sidecar.model.families.base import SLIDING, Family


class Llama(Family):
    model_types = ("llama",)

    def layer_windows(self, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return (None,) * num_layers


class Qwen2(Family):
    """Qwen2/2.5: q/k/v biases always; a window only where `use_sliding_window` turns it on, on the
    layers from `max_window_layers` (or as `layer_types` names them)."""

    model_types = ("qwen2",)

    def qkv_bias(self, raw: dict[str, Any]) -> bool:
        return True

    def layer_windows(self, raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
        return qwen_windows(raw, num_layers)


def qwen_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or not window:
        return (None,) * num_layers
    types = raw.get("layer_types") or [
        SLIDING if i >= int(raw.get("max_window_layers", num_layers)) else "full_attention" for i in range(num_layers)
    ]
    return tuple(int(window) if t == SLIDING else None for t in types)


class Mistral(Family):
    """Mistral: one window on every layer (none where `sliding_window` is null); Ministral names
    each layer's attention in `layer_types`."""

    model_types = ("mistral", "ministral")
