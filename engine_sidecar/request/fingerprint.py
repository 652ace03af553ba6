"""Fingerprints that make a chunk cache impossible to reuse across models, tokenizers or dtypes."""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from engine_sidecar.model.weights import safetensors_files
from engine_sidecar.paths import ragcache_home

_READ = 8 << 20


def _file_digest(path: Path) -> str:
    """blake2b of a file's bytes, memoized on disk by (path, size, mtime) since weights are large."""
    st = path.stat()
    memo_path = ragcache_home() / "fingerprints.json"
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, json.JSONDecodeError):
        memo = {}
    if stamp in memo:
        return memo[stamp]
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while block := f.read(_READ):
            h.update(block)
    memo[stamp] = h.hexdigest()
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError:
        pass  # a read-only home only costs a re-hash next start
    return memo[stamp]


def _weights_hash(model_dir: Path) -> hashlib.blake2b:
    h = hashlib.blake2b(digest_size=16)
    h.update((model_dir / "config.json").read_bytes())
    for path in safetensors_files(model_dir):
        h.update(_file_digest(path).encode())
    return h


def model_fingerprint(model_dir: Path, dtype: torch.dtype) -> str:
    h = _weights_hash(model_dir)
    h.update(str(dtype).encode())
    return h.hexdigest()


def weights_fingerprint(model_dir: Path) -> str:
    """The model's identity whatever dtype it runs in: what a calibration fitted on it is keyed by."""
    return _weights_hash(model_dir).hexdigest()


def tokenizer_fingerprint(model_dir: Path, chat_template: str | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            h.update(name.encode())
            h.update(path.read_bytes())
    h.update((chat_template or "").encode())
    return h.hexdigest()


def token_ids_digest(token_ids: Sequence[int]) -> str:
    """The content identity of a token sequence: blake2b of its ids as int64 in the machine's
    byte order (the bytes stored keys were always named by)."""
    return _digest_of(tuple(token_ids))


# A planned request names the same passages' tokens a few dozen times (keys per context, chain
# digests, CP-Tree edges); remembering the last few thousand digests takes that hashing off the
# request path. The tuples are mostly the ones the prompt builder's token cache holds already.
@functools.lru_cache(maxsize=4096)
def _digest_of(token_ids: tuple[int, ...]) -> str:
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()
