"""Read a HF safetensors folder into plain tensors (no transformers at run time). Which tensors a
layer takes, and how they are laid out, is its family's (`model/families/`); this module reads the
files, hands tensors out by name and refuses a folder with tensors nobody took."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine_sidecar.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError
from engine_sidecar.model.layers import DecoderLayer, Norm


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[DecoderLayer]
    final_norm: Norm
    lm_head: torch.Tensor
    embed_scale: torch.Tensor | None = None  # Gemma: embeddings times sqrt(hidden), in their dtype
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)


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


class Tensors:
    """A folder's tensors, handed out once each by name, converted to the runner's dtype and device
    (`raw` keeps the file's dtype and the host, for weights a family rearranges first)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 named: dict[str, torch.Tensor] | None = None):
        self.model_dir, self.dtype, self.device = model_dir, dtype, device
        self.left = dict(named) if named is not None else _read_all(safetensors_files(model_dir))

    def has(self, name: str) -> bool:
        return name in self.left

    def peek(self, name: str) -> torch.Tensor | None:
        return self.left.get(name)

    def raw(self, name: str) -> torch.Tensor:
        tensor = self.left.pop(name, None)
        if tensor is None:
            raise CorruptModelError(f"tensor '{name}' is missing from {self.model_dir}; the folder is incomplete")
        return tensor

    def place(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous()

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.place(self.raw(name), dtype)

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.left else None

    def fused(self, *names: str, optional: bool = False) -> torch.Tensor | None:
        """These tensors stacked along rows (one matmul for all), None when `optional` and all are
        absent."""
        present = [n in self.left for n in names]
        if optional and not any(present):
            return None
        if not all(present):
            raise CorruptModelError(f"some of {names} are missing from {self.model_dir}; the folder is incomplete")
        return self.place(torch.cat([self.raw(n) for n in names], dim=0))

    def refuse_leftovers(self) -> None:
        """A tensor the forward would not use (an o_proj bias, MLP biases, ...) means another variant
        of the architecture: ignoring it would give wrong outputs silently."""
        unused = sorted(k for k in self.left if not k.endswith("rotary_emb.inv_freq"))
        if unused:
            shown = ", ".join(sorted({k.split(".", 3)[-1] if k.startswith("model.layers.") else k
                                      for k in unused})[:4])
            raise UnsupportedModelError(
                f"{self.model_dir} has {len(unused)} tensors this runner does not use ({shown}): this variant of "
                f"the architecture is not supported"
            )


def check_q_shape(tensors: Tensors, name: str, expected: tuple[int, int]) -> None:
    q = tensors.peek(name)
    if q is not None and tuple(q.shape) != expected:
        raise CorruptModelError(
            f"{name.rsplit('.', 2)[-2]} has shape {tuple(q.shape)}, config.json implies {expected}; "
            "config and weights do not belong together"
        )
