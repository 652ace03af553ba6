"""The GPU kit: `ragcache bench gpu` on a CUDA machine that has torch, Triton and transformers but
no network, no pydantic or fastapi, and no install of this project (a plain checkout).

Here (with the package registries in reach):

    python -m ragcache_lab.gpu_kit pack          # or: make gpu-kit

writes `.gpu-kit/`: wheels for the server stack at the versions installed here (pydantic, fastapi,
uvicorn, prometheus-client and what they need, for CPython 3.12 on x86-64 Linux), and the default
model's tokenizer files (the benchmark's models have random weights; only the tokenizer is real). There, from the
checkout's root, with `.gpu-kit` carried beside it:

    python3 -m ragcache_lab.gpu_kit run --out "$OUT" [-- bench gpu flags]

installs the wheels into a folder of their own, makes `ragcache_kernels` importable from
`kernels/`, and runs the benchmark with the kit's tokenizer, its log beside its JSON and table.
This module imports nothing beyond the standard library at the top, so `run` works before the
wheels are in place."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
SITE = Path("/tmp/ragcache-gpu-site")
# the server extra's own requirements: what the sidecar's app needs beyond torch, Triton,
# transformers, httpx, numpy and rich (prometheus-client is in the GPU image as it stands, but the
# kit does not count on it)
SERVER_ROOTS = ("pydantic", "fastapi", "uvicorn", "prometheus-client")
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


# --- here: pack ----------------------------------------------------------------------------------
def requirement_closure(roots: tuple[str, ...], python_version: str = TARGET_PYTHON) -> dict[str, str]:
    """Distribution name -> the version installed here, for `roots` and everything they require
    (extras left out; markers evaluated for the target Python, not this one)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"ragcache: error: {name} is not installed here: install the server extra "
                             "(pip install 'ragcache[server]') before packing the kit") from None
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            env = {"extra": "", "python_version": python_version, "python_full_version": f"{python_version}.0"}
            if req.marker is None or req.marker.evaluate(env):
                pending.append(req.name)
    return dict(sorted(found.items()))


def pack(kit: Path, tokenizer: Path | None, python_version: str = TARGET_PYTHON) -> dict[str, object]:
    from ragcache_lab.gpu_models import TOKENIZER_FILES

    wheels = kit / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    versions = requirement_closure(SERVER_ROOTS, python_version)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pins = [f"{name}=={version}" for name, version in versions.items()]
    print(f"downloading {len(pins)} wheels for CPython {python_version}: {' '.join(pins)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(wheels),
                           *pins])
    if done.returncode != 0:
        raise SystemExit("ragcache: error: pip could not download the kit's wheels (above); it needs the "
                         "package registries")
    source = tokenizer or _default_model_dir()
    (kit / "tokenizer").mkdir(exist_ok=True)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"ragcache: error: {source} holds no tokenizer.json (give --tokenizer FOLDER)")
    for name in copied:
        shutil.copy(source / name, kit / "tokenizer" / name)
    manifest = {"python": python_version, "wheels": versions, "tokenizer_from": str(source), "tokenizer": copied}
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    print(f"wrote {kit} ({size / 2**20:.1f} MiB): carry it beside the checkout and run\n"
          f"  python3 -m ragcache_lab.gpu_kit run --out \"$OUT\"")
    return manifest


def _default_model_dir() -> Path:
    from engine_sidecar.model.prepare import resolve_model_dir

    return resolve_model_dir("default")


# --- there: run ----------------------------------------------------------------------------------
def install(kit: Path, site: Path) -> None:
    """The kit's wheels into `site`, and `ragcache_kernels` (the `kernels/` folder, as the package
    install would name it) beside them."""
    wheels = sorted((kit / "wheels").glob("*.whl"))
    site.mkdir(parents=True, exist_ok=True)
    if wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                               *map(str, wheels)])
        if done.returncode != 0:
            raise SystemExit(f"ragcache: error: the kit's wheels did not install into {site} (above)")
    link = site / "ragcache_kernels"
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        shutil.rmtree(link)
    link.symlink_to(ROOT / "kernels", target_is_directory=True)


def run(kit: Path, out: Path, bench_args: list[str], site: Path = SITE) -> int:
    if not (kit / "tokenizer" / "tokenizer.json").is_file():
        raise SystemExit(f"ragcache: error: {kit} is not a packed kit (run `make gpu-kit` where the registries are "
                         "in reach, and carry .gpu-kit)")
    install(kit, site)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "ragcache_lab.gpu", "--tokenizer", str(kit / "tokenizer"),
               "--out", str(out), *bench_args]
    print("$ " + " ".join(command), flush=True)
    with open(out / "bench-gpu.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        assert proc.stdout is not None
        for line in proc.stdout:  # to the console and the log, as it comes
            sys.stdout.write(line)
            log.write(line)
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ragcache_lab.gpu_kit", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser("pack", help="here: the wheels and the tokenizer into the kit folder")
    packing.add_argument("--kit", type=Path, default=KIT, help=f"kit folder (default {KIT.name} in the checkout)")
    packing.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the default model's)")
    packing.add_argument("--python", default=TARGET_PYTHON,
                         help=f"the GPU machine's Python, X.Y (default {TARGET_PYTHON}, the image's)")
    running = verbs.add_parser("run", help="there: install the kit, then run `ragcache bench gpu`")
    running.add_argument("--kit", type=Path, default=KIT, help=f"kit folder (default {KIT.name} in the checkout)")
    running.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-results/gpu")),
                         help="folder for bench-gpu.json, .md and .log (default $OUT, else bench-results/gpu)")
    running.add_argument("--site", type=Path, default=SITE, help=f"where the wheels install (default {SITE})")
    running.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: flags for `ragcache bench gpu`")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        pack(args.kit, args.tokenizer, args.python)
        return 0
    extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    return run(args.kit, args.out, extra, args.site)


if __name__ == "__main__":
    raise SystemExit(main())
