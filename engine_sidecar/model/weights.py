"""Load a Llama-family HF safetensors folder into plain tensors (no transformers at run time)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine_sidecar.errors import CorruptModelError, ModelNotFoundError
from engine_sidecar.model.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"no *.safetensors in {model_dir}: give a Hugging Face safetensors folder "
            "(or convert a GGUF with `ragcache model prepare --gguf FILE`)"
        )
    return files


def _read_all(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if not path.is_file():
            raise ModelNotFoundError(f"weights file {path} is missing; re-create the model folder")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CorruptModelError(
                f"cannot read {path} ({str(exc).splitlines()[0]}); the file is damaged: "
                "re-create it (`ragcache model prepare --force` for the default model)"
            ) from exc
    return tensors


def load_weights(model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    raw = _read_all(safetensors_files(model_dir))

    def take(name: str, optional: bool = False) -> torch.Tensor | None:
        tensor = raw.pop(name, None)
        if tensor is None:
            if optional:
                return None
            raise CorruptModelError(f"tensor '{name}' is missing from {model_dir}; the folder is incomplete")
        return tensor.to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                q_proj=take(p + "self_attn.q_proj.weight"),
                k_proj=take(p + "self_attn.k_proj.weight"),
                v_proj=take(p + "self_attn.v_proj.weight"),
                o_proj=take(p + "self_attn.o_proj.weight"),
                q_bias=take(p + "self_attn.q_proj.bias", optional=not config.qkv_bias),
                k_bias=take(p + "self_attn.k_proj.bias", optional=not config.qkv_bias),
                v_bias=take(p + "self_attn.v_proj.bias", optional=not config.qkv_bias),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_proj=take(p + "mlp.gate_proj.weight"),
                up_proj=take(p + "mlp.up_proj.weight"),
                down_proj=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = take("lm_head.weight", optional=True)
    if lm_head is None:
        if not config.tie_word_embeddings:
            raise CorruptModelError(f"tensor 'lm_head.weight' is missing from {model_dir}")
        lm_head = embed
    expected = (config.num_heads * config.head_dim, config.hidden_size)
    if tuple(layers[0].q_proj.shape) != expected:
        raise CorruptModelError(
            f"q_proj has shape {tuple(layers[0].q_proj.shape)}, config.json implies {expected}; "
            "config and weights do not belong together"
        )
    return ModelWeights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)
