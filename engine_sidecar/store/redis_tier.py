"""Shared tier on Redis: chunk KV that every sidecar pointed at the same Redis can reuse.

One Redis hash per chunk entry, so an eviction (`maxmemory-policy allkeys-lru`) or an expiry
removes a chunk whole. Key: `<prefix>:<CacheKey digest>`; the digest already hashes the model and
tokenizer fingerprints, the tenant and the context, so another tenant's (or model's) lookup can
only name another key. Fields:

- `seg:<i>`: layers [l0, l1) of the KV, keys then values, raw bytes; about `segment_bytes` each
  (always whole layers), so a reader could start on the early layers first;
- `tokens`: the token ids (int64), `scores`: CacheTune frequency scores (float32);
- `meta`, written last in the same MULTI/EXEC: `<xxh64 of the JSON> <JSON>` with the format
  version, digest, dtype, shape, each segment's layer range and xxh64, the tokens' and scores'
  xxh64, chunk id, tenant and the entry's metadata.

A hash without `meta` (a write cut short), or one whose checksums, lengths or shapes disagree, is
deleted, counted as corrupt and reported as a miss: the chunk is recomputed. A TTL is set on
write and refreshed on every hit.

Redis down or slow never reaches the caller: every call has short socket timeouts and no retries,
and a circuit breaker stops calling for `cooldown_s` after `failures_to_open` failures in a row
(then one call is tried again). A failed read is a miss, a failed write is dropped; both are
counted. Writes go through a background thread with a byte-bounded queue (store/write_queue.py, shared
with the disk tier).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch

from engine_sidecar.store.entry import ChunkKV, finite_kv
from engine_sidecar.store.write_queue import WriteQueue

log = logging.getLogger("ragcache.store")

FORMAT_VERSION = 1
SEGMENT_BYTES = 4 << 20
DEFAULT_PREFIX = "ragcache:kv"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FAILED = object()  # what `_call` returns when Redis could not be asked


class CorruptEntry(ValueError):
    """A Redis hash that is not a whole, intact chunk entry."""


def redacted(url: str) -> str:
    """The URL without its password, for logs and banners."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<invalid url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class CircuitBreaker:
    """Closed until `failures_to_open` failures in a row; then open (nothing tried) for
    `cooldown_s`; then half-open: calls are tried again, one more failure opens it again at once,
    a success closes it."""

    def __init__(self, failures_to_open: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.failures_to_open = max(1, failures_to_open)
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.failures = 0  # in a row
        self.opened = 0  # times it opened
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.clock() < self._open_until

    def allow(self) -> bool:
        return not self.is_open

    def success(self) -> None:
        with self._lock:
            self.failures = 0
            self._open_until = 0.0

    def failure(self) -> bool:
        """Count one failure; whether the breaker opened with it."""
        with self._lock:
            self.failures += 1
            if self.failures >= self.failures_to_open and not self.is_open:
                self._open_until = self.clock() + self.cooldown_s
                self.opened += 1
                return True
            return False


@dataclass
class RedisCounters:
    hits: int = 0
    misses: int = 0  # lookups Redis answered with no entry
    corrupt: int = 0  # entries found partial or damaged: deleted, the chunk recomputed
    errors: int = 0  # calls that failed (connection refused, timeout, any error): a miss or a dropped write
    skipped: int = 0  # calls not made because the breaker was open
    writes: int = 0  # entries written
    writes_dropped: int = 0  # entries not written: the write queue was over its byte bound
    last_errors: list[str] = field(default_factory=list)  # the last few failure messages (newest last)


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _xxh(data: bytes) -> str:
    import xxhash

    return xxhash.xxh64_hexdigest(data)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {name} cannot be stored in the Redis tier")
    return name


def encode(digest: str, entry: ChunkKV, segment_bytes: int = SEGMENT_BYTES) -> dict[str, bytes]:
    """The hash's fields for one entry, `meta` last."""
    entry.wait_ready()  # a host copy still landing from the device
    keys, values = entry.keys.detach().cpu().contiguous(), entry.values.detach().cpu().contiguous()
    if keys.shape != values.shape or keys.dtype != values.dtype or keys.dim() != 4:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not match")
    layers = keys.shape[0]
    per_layer = 2 * (keys[0].nbytes if layers else 0)
    step = max(1, segment_bytes // max(1, per_layer))
    fields: dict[str, bytes] = {}
    segments = []
    for i, first in enumerate(range(0, layers, step)):
        last = min(layers, first + step)
        data = _raw(keys[first:last]) + _raw(values[first:last])
        fields[f"seg:{i}"] = data
        segments.append([first, last, _xxh(data)])
    token_ids = entry.token_ids.detach().cpu().to(torch.int64)
    fields["tokens"] = _raw(token_ids)
    fields["scores"] = _raw(entry.tune_scores())
    body = {"v": FORMAT_VERSION, "digest": digest, "dtype": _dtype_name(keys.dtype), "shape": list(keys.shape),
            "segments": segments, "tokens": _xxh(fields["tokens"]), "scores": _xxh(fields["scores"]),
            "chunk_id": entry.chunk_id or "", "tenant": entry.tenant,
            "meta": {k: str(v) for k, v in entry.meta.items() if not k.startswith("_")}}
    text = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    fields["meta"] = _xxh(text).encode() + b" " + text
    return fields


def read_meta(raw: bytes | None) -> dict[str, Any]:
    """The verified `meta` field."""
    if not raw:
        raise CorruptEntry("no meta field (a partial write)")
    checksum, _, text = raw.partition(b" ")
    if checksum.decode(errors="replace") != _xxh(text):
        raise CorruptEntry("meta checksum mismatch")
    body = json.loads(text)
    if body.get("v") != FORMAT_VERSION:
        raise CorruptEntry(f"format version {body.get('v')!r}, not {FORMAT_VERSION}")
    return body


def decode(digest: str, fields: dict[bytes, bytes]) -> ChunkKV:
    """The entry from a hash's fields, every checksum, length and shape verified."""
    meta = read_meta(fields.get(b"meta"))
    if meta["digest"] != digest:
        raise CorruptEntry("digest mismatch")
    dtype = _DTYPES.get(meta["dtype"])
    shape = tuple(int(x) for x in meta["shape"])
    if dtype is None or len(shape) != 4 or min(shape) < 0:
        raise CorruptEntry(f"bad dtype or shape: {meta['dtype']} {shape}")
    layers, n = shape[0], shape[1]
    keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    layer_bytes = keys[0].nbytes if layers else 0
    key_bytes, value_bytes = keys.reshape(-1).view(torch.uint8).numpy(), values.reshape(-1).view(torch.uint8).numpy()
    import numpy as np

    covered = 0
    for i, (first, last, checksum) in enumerate(meta["segments"]):
        data = fields.get(f"seg:{i}".encode())
        if data is None:
            raise CorruptEntry(f"segment {i} missing")
        if first != covered or not first < last <= layers:
            raise CorruptEntry(f"segment {i} covers layers {first}-{last}, expected from {covered}")
        half = (last - first) * layer_bytes
        if len(data) != 2 * half:
            raise CorruptEntry(f"segment {i} has {len(data)} bytes, expected {2 * half}")
        if _xxh(data) != checksum:
            raise CorruptEntry(f"segment {i} checksum mismatch")
        buf = np.frombuffer(data, dtype=np.uint8)
        key_bytes[first * layer_bytes:last * layer_bytes] = buf[:half]
        value_bytes[first * layer_bytes:last * layer_bytes] = buf[half:]
        covered = last
    if covered != layers:
        raise CorruptEntry(f"segments cover {covered} of {layers} layers")
    token_ids = _tensor(fields.get(b"tokens"), meta["tokens"], torch.int64, n, "tokens")
    scores = _tensor(fields.get(b"scores"), meta["scores"], torch.float32, n, "scores")
    return ChunkKV(keys, values, token_ids, meta["chunk_id"] or None, meta["tenant"], dict(meta["meta"]),
                   scores=scores)


def _tensor(data: bytes | None, checksum: str, dtype: torch.dtype, n: int, name: str) -> torch.Tensor:
    out = torch.empty(n, dtype=dtype)
    if data is None or len(data) != out.nbytes:
        raise CorruptEntry(f"{name}: {len(data) if data is not None else 'no'} bytes, expected {out.nbytes}")
    if _xxh(data) != checksum:
        raise CorruptEntry(f"{name} checksum mismatch")
    if n:
        import numpy as np

        out.view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out


class RedisTier:
    """The shared tier. `client` (a redis.Redis) is for tests; otherwise one is made from `url`."""

    def __init__(self, url: str, ttl_s: float = 86400.0, prefix: str = DEFAULT_PREFIX, timeout_s: float = 0.2,
                 failures_to_open: int = 3, cooldown_s: float = 5.0, segment_bytes: int = SEGMENT_BYTES,
                 max_pending_bytes: int = 256 << 20, flush_timeout_s: float = 30.0, client: Any = None):
        self.url, self.prefix = url, prefix
        self.ttl_ms = max(1, int(ttl_s * 1000)) if ttl_s > 0 else 0  # 0: no expiry (maxmemory evicts)
        self.segment_bytes = segment_bytes
        self.flush_timeout_s = flush_timeout_s
        if client is None:
            try:
                import redis
                import xxhash  # noqa: F401 - checked here, used per entry
            except ImportError as exc:
                raise ImportError(f"the Redis tier needs the redis extra: pip install 'ragcache[redis]' ({exc})") from exc
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # no retries: one slow or refused call is one failure for the breaker, bounded by the timeouts
            client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self.client = client
        self.breaker = CircuitBreaker(failures_to_open, cooldown_s)
        self.counters = RedisCounters()
        self._lock = threading.Lock()  # guards the counters
        # a write removed while under way is deleted again once it has landed (`on_cancelled`), so
        # a delete never loses to the write it raced
        self._writes: WriteQueue[ChunkKV] = WriteQueue("ragcache-redis-writer", self.write, max_pending_bytes,
                                                       on_cancelled=self._delete_landed)

    @property
    def shown_url(self) -> str:
        """The URL without its password."""
        return redacted(self.url)

    def key(self, digest: str) -> str:
        return f"{self.prefix}:{digest}"

    # --- calls -----------------------------------------------------------------------------------
    def _count(self, name: str, message: str | None = None) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + 1)
            if message is not None:
                self.counters.last_errors = [*self.counters.last_errors[-9:], message]

    def _call(self, what: str, op: Callable[[Any], Any]) -> Any:
        """op(client), or _FAILED: the breaker was open, or the call failed (counted, logged)."""
        if not self.breaker.allow():
            self._count("skipped")
            return _FAILED
        try:
            result = op(self.client)
        except Exception as exc:  # noqa: BLE001 - Redis trouble of any kind is a miss, never an error
            self._count("errors", f"{what}: {exc!r}")
            if not _outage(exc):  # Redis answered (an error reply, e.g. out of memory): it is up
                log.warning("Redis tier %s failed: %r", what, exc)
                self.breaker.success()
            elif self.breaker.failure():
                log.warning("Redis tier at %s failing (%s: %r): not used for %g s", self.shown_url, what, exc,
                            self.breaker.cooldown_s)
            return _FAILED
        self.breaker.success()
        return result

    # --- reads -----------------------------------------------------------------------------------
    def get(self, digest: str) -> ChunkKV | None:
        """The entry (its TTL refreshed), or None: absent, damaged (then deleted), or Redis failing."""
        key = self.key(digest)

        def read(client):
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(key)
            if self.ttl_ms:
                pipe.pexpire(key, self.ttl_ms)
            return pipe.execute()[0]

        fields = self._call("read", read)
        if fields is _FAILED:
            return None
        if not fields:
            self._count("misses")
            return None
        try:
            entry = decode(digest, fields)
            if not finite_kv(entry.keys, entry.values):  # intact, but poisoned by whoever wrote it
                raise ValueError("NaN or infinity in the KV")
        except Exception as exc:  # any damage at all ends as a miss, never a crash
            self._count("corrupt", f"{digest}: {exc}")
            log.warning("Redis entry %s is damaged (%s); deleting it, the chunk is recomputed", key, exc)
            self._call("delete", lambda client: client.delete(key))
            return None
        self._count("hits")
        return entry

    def contains(self, digest: str) -> bool:
        found = self._call("exists", lambda client: client.exists(self.key(digest)))
        return found is not _FAILED and bool(found)

    # --- writes ----------------------------------------------------------------------------------
    def put(self, digest: str, entry: ChunkKV) -> None:
        """Queue one entry for writing; dropped (and counted) when the queue already holds
        `max_pending_bytes`, or while the breaker is open (nothing would be written)."""
        if not self.breaker.allow():
            self._count("skipped")
            return
        if not self._writes.put(digest, entry, entry.nbytes):
            self._count("writes_dropped", f"{digest}: write queue full")

    def write(self, digest: str, entry: ChunkKV) -> bool:
        """Write one entry now (on the calling thread): every data field, then `meta`, then the
        TTL, in one MULTI/EXEC; False if it was not written."""
        try:
            entry.wait_ready()
            if not finite_kv(entry.keys, entry.values):
                raise ValueError("NaN or infinity in the KV")
            fields = encode(digest, entry, self.segment_bytes)
        except Exception as exc:  # noqa: BLE001 - an entry that cannot be encoded is not stored
            self._count("errors", f"{digest}: {exc!r}")
            log.warning("could not encode chunk %s for the Redis tier: %r", digest, exc)
            return False
        key = self.key(digest)

        def write(client):
            pipe = client.pipeline(transaction=True)
            pipe.delete(key)  # a rewrite may have fewer segments
            for name, data in fields.items():  # meta is the last field
                pipe.hset(key, name, data)
            if self.ttl_ms:
                pipe.pexpire(key, self.ttl_ms)
            pipe.execute()

        if self._call("write", write) is _FAILED:
            return False
        self._count("writes")
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the writes queued so far; False if they did not finish within the bound."""
        return self._writes.flush(self.flush_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> bool:
        """Finish the writes queued so far (within the flush bound) and end the writer thread."""
        return self._writes.close(self.flush_timeout_s)

    # --- deletes ---------------------------------------------------------------------------------
    def remove_many(self, digests: Iterable[str]) -> set[str]:
        """Delete these entries (and their queued writes); the digests Redis held."""
        digests = list(digests)
        if not digests:
            return set()
        self._writes.discard(set(digests))

        def delete(client):
            pipe = client.pipeline(transaction=False)
            for digest in digests:
                pipe.delete(self.key(digest))
            return pipe.execute()

        counts = self._call("delete", delete)
        if counts is _FAILED:
            return set()
        return {d for d, n in zip(digests, counts, strict=True) if n}

    def _delete_landed(self, digest: str) -> None:
        self._call("delete", lambda client: client.delete(self.key(digest)))

    def digests_of(self, chunk_id: str | None, tenant: str | None) -> set[str]:
        """Digests of the entries of one chunk id and/or one tenant (None: any), read from each
        entry's meta with SCAN: a walk over the prefix's keys, for deletes only."""
        found: set[str] = set()

        def scan(client):
            for batch in _batches(client.scan_iter(match=f"{self.prefix}:*", count=500), 500):
                pipe = client.pipeline(transaction=False)
                for key in batch:
                    pipe.hget(key, "meta")
                for key, raw in zip(batch, pipe.execute(), strict=True):
                    try:
                        meta = read_meta(raw)
                    except Exception:  # noqa: BLE001 - a damaged entry is found and deleted on its next read
                        continue
                    if (chunk_id is None or meta["chunk_id"] == chunk_id) and (tenant is None or meta["tenant"] == tenant):
                        found.add(key.decode().rpartition(":")[2])
            return found

        result = self._call("scan", scan)
        return set() if result is _FAILED else result

    def clear(self) -> set[str]:
        """Delete every entry under the prefix (every tenant's, and every sidecar's sharing it);
        the digests removed (the caller counts a chunk other tiers also held once)."""
        self._writes.clear()  # queued writes are dropped
        self.flush()  # the write under way, if any

        def clear(client):
            removed: set[str] = set()
            for batch in _batches(client.scan_iter(match=f"{self.prefix}:*", count=500), 500):
                pipe = client.pipeline(transaction=False)
                for key in batch:  # one UNLINK a key: which of them existed, not just how many
                    pipe.unlink(key)
                removed.update(key.decode().rpartition(":")[2] for key, n in zip(batch, pipe.execute(), strict=True)
                               if n)
            return removed

        removed = self._call("clear", clear)
        return set() if removed is _FAILED else removed


def _outage(exc: BaseException) -> bool:
    """Whether a failure means Redis could not be reached in time (what the breaker counts), not
    an error reply from a Redis that answered."""
    import redis

    return isinstance(exc, redis.ConnectionError | redis.TimeoutError | OSError) or not isinstance(
        exc, redis.RedisError)


def _batches(items: Iterable[Any], size: int) -> Iterable[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
