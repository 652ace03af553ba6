"""The model families the engine runs, and the ones it refuses with the reason.

A family reads its `config.json` and builds its layers (`base.Family`); everything above the
model package calls the layers' steps and never asks which family it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine_sidecar.errors import UnsupportedModelError
from engine_sidecar.model.config import ModelConfig, read_config_json
from engine_sidecar.model.families.base import Family
from engine_sidecar.model.families.gemma3 import Gemma3
from engine_sidecar.model.families.llama import Llama, Mistral, Qwen2
from engine_sidecar.model.families.phi3 import Phi3
from engine_sidecar.model.families.qwen3 import Qwen3, Qwen3Moe
from engine_sidecar.model.weights import ModelWeights, Tensors

FAMILIES: tuple[Family, ...] = (Llama(), Qwen2(), Mistral(), Qwen3(), Qwen3Moe(), Gemma3(), Phi3())
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)

_RECURRENT = ("a hybrid linear-attention model: its recurrent state is not position-free, so a chunk's cache "
              "cannot be placed anywhere but at the exact prefix it was computed in")
_MLA = ("a latent-attention (MLA) model: its keys are compressed with RoPE applied to a separate part, which "
        "this engine's position-free chunk store does not model")
_VISION = ("a vision-language model: ragcache serves text-only models (use the text model's own folder, "
           "e.g. a `gemma3_text` or `qwen3` checkpoint)")
REFUSED: dict[str, str] = {
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "mamba", "mamba2",
                     "jamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "bamba", "zamba", "zamba2", "lfm2",
                     "lfm2_moe", "nemotron_h", "minimax", "recurrent_gemma", "rwkv", "olmo_hybrid"), _RECURRENT),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_linear", "longcat_flash",
                     "glm4_moe_lite"), _MLA),
    **dict.fromkeys(("gemma3", "gemma3n", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe",
                     "llava", "llava_next", "mllama", "mistral3", "ministral3", "paligemma", "idefics3",
                     "phi4_multimodal", "phi3_v", "internvl", "smolvlm", "llama4"), _VISION),
}


def family_of(raw: dict[str, Any], where: Path | str = "config.json") -> Family:
    """The family that runs this config, or UnsupportedModelError naming why not."""
    model_type = raw.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in REFUSED:
        raise UnsupportedModelError(f"model type '{model_type}' in {where} is not supported: {REFUSED[model_type]}")
    raise UnsupportedModelError(
        f"model type '{model_type}' in {where} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    )


def load_config(model_dir: Path) -> ModelConfig:
    """The folder's config, read by its family."""
    from engine_sidecar.errors import CorruptModelError

    raw = read_config_json(model_dir)
    path = Path(model_dir) / "config.json"
    family = family_of(raw, path)
    try:
        return family.read_config(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"{path} lacks or mangles a field its model type needs ({exc!r})") from exc


def load_weights(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 named: dict[str, torch.Tensor] | None = None) -> ModelWeights:
    """The folder's weights built into its family's layers; `named`: tensors already in hand (a
    shape's random weights, named as a checkpoint names them) instead of the folder's files."""
    tensors = Tensors(Path(model_dir), dtype, device, named)
    family = family_of({"model_type": config.model_type}, Path(model_dir) / "config.json")
    weights = family.load(tensors, config)
    tensors.refuse_leftovers()
    return weights
