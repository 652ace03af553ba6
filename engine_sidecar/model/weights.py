"""Load a Llama-family HF safetensors folder into plain tensors (no transformers at run time)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine_sidecar.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from engine_sidecar.model.config import ModelConfig


@dataclass
class LayerWeights:
    """One decoder layer. q/k/v and gate/up are stored fused (one matmul each); the per-projection
    tensors are views into the fused ones, kept for readers that want them by name."""

    input_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [(H + 2 Hkv) * D, hidden]: q rows, then k, then v
    qkv_bias: torch.Tensor | None  # Qwen2 only
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up
    down_proj: torch.Tensor
    q_size: int
    kv_size: int

    @property
    def q_proj(self) -> torch.Tensor:
        return self.qkv_proj[: self.q_size]

    @property
    def k_proj(self) -> torch.Tensor:
        return self.qkv_proj[self.q_size : self.q_size + self.kv_size]

    @property
    def v_proj(self) -> torch.Tensor:
        return self.qkv_proj[self.q_size + self.kv_size :]

    def _bias(self, start: int, end: int) -> torch.Tensor | None:
        return None if self.qkv_bias is None else self.qkv_bias[start:end]

    @property
    def q_bias(self) -> torch.Tensor | None:
        return self._bias(0, self.q_size)

    @property
    def k_bias(self) -> torch.Tensor | None:
        return self._bias(self.q_size, self.q_size + self.kv_size)

    @property
    def v_bias(self) -> torch.Tensor | None:
        return self._bias(self.q_size + self.kv_size, self.q_size + 2 * self.kv_size)

    @property
    def gate_proj(self) -> torch.Tensor:
        return self.gate_up_proj[: self.gate_up_proj.shape[0] // 2]

    @property
    def up_proj(self) -> torch.Tensor:
        return self.gate_up_proj[self.gate_up_proj.shape[0] // 2 :]


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

    def fused(*names: str, optional: bool = False) -> torch.Tensor | None:
        parts = [take(n, optional) for n in names]
        if all(t is None for t in parts) and optional:
            return None
        if any(t is None for t in parts):
            raise CorruptModelError(f"some of {names} are missing from {model_dir}; the folder is incomplete")
        return torch.cat(parts, dim=0).contiguous()

    expected = (config.num_heads * config.head_dim, config.hidden_size)
    q_shape = raw.get("model.layers.0.self_attn.q_proj.weight")
    if q_shape is not None and tuple(q_shape.shape) != expected:
        raise CorruptModelError(
            f"q_proj has shape {tuple(q_shape.shape)}, config.json implies {expected}; "
            "config and weights do not belong together"
        )
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}.self_attn."
        m = f"model.layers.{i}.mlp."
        layers.append(
            LayerWeights(
                input_norm=take(f"model.layers.{i}.input_layernorm.weight"),
                qkv_proj=fused(p + "q_proj.weight", p + "k_proj.weight", p + "v_proj.weight"),
                qkv_bias=fused(p + "q_proj.bias", p + "k_proj.bias", p + "v_proj.bias", optional=not config.qkv_bias),
                o_proj=take(p + "o_proj.weight"),
                post_norm=take(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up_proj=fused(m + "gate_proj.weight", m + "up_proj.weight"),
                down_proj=take(m + "down_proj.weight"),
                q_size=config.num_heads * config.head_dim,
                kv_size=config.num_kv_heads * config.head_dim,
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = take("lm_head.weight", optional=True)
    if lm_head is None:
        if not config.tie_word_embeddings:
            raise CorruptModelError(f"tensor 'lm_head.weight' is missing from {model_dir}")
        lm_head = embed
    final_norm = take("model.norm.weight")
    # a tensor the forward would not use (an o_proj bias, MLP biases, ...) means another variant of
    # the architecture: ignoring it would give wrong outputs silently
    unused = sorted(k for k in raw if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        shown = ", ".join(sorted({k.split(".", 3)[-1] if k.startswith("model.layers.") else k for k in unused})[:4])
        raise UnsupportedModelError(
            f"{model_dir} has {len(unused)} tensors this runner does not use ({shown}): this variant of "
            f"the architecture is not supported"
        )
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
