"""Soak: a real `ragcache serve` with small RAM and disk budgets under N concurrent clients for a
while, its memory and disk sampled, to show that nothing fails and nothing grows.

Each client loops over a RAG-like mix drawn from a corpus (musique_s.json shape): generate
requests over a record's passages (popular records come back, so chunks are reused, evicted and
recomputed), multi-turn conversations, streamed requests, chat completions with chunks, deletes
of single chunks, stats reads, and invalid requests that must be answered with a 4xx. A sampler
reads the server's RSS, the bytes of files under its cache folder (walked, not the server's own
count) and /v1/cache/stats every `--sample-every` seconds.

The verdict: no 5xx and no transport error; the RAM tier's bytes within its budget in every
sample; the folder within the disk budget (plus one file: a rewrite of a digest briefly holds the
old file and the new temp file); RSS bounded, meaning that after the warm-up it stops growing: the
peak of the last third of the samples after the warm-up is within 5% + 32 MiB of the peak before
it. RSS is a sawtooth under concurrent load (it rises while requests hold their KV buffers and
falls when they finish), so peaks are compared, not a slope. And RSS within its bound: every
sample after the warm-up at most "RSS at idle (the model loaded) + RAM tier + the running
requests' KV budget (`--batch-kv-gb`) + the disk write queue's bound (1 GiB) + conversation budget
+ passage memory (`--passage-memory-mb`) + `--rss-allowance-mb` (activations, allocator slack)", each term a budget the server enforces.
`--rejudge soak.json` prints the table of an earlier run again.

    python -m ragcache_lab.soak --clients 8 --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine_sidecar.server.process import SidecarProcess

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "musique_s.json"
MIB = 1 << 20
DISK_WRITE_QUEUE_BYTES = 1 << 30  # DiskTier's max_pending_bytes: entries past it are dropped, not held

# share of each kind in a client's mix (the rest of the weight is plain generate requests)
MIX = {"generate": 0.52, "conversation": 0.16, "stream": 0.07, "chat": 0.07, "delete": 0.05, "stats": 0.03,
       "invalid": 0.10}


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_bytes: int
    disk_folder_bytes: int  # files under the cache folder, walked
    disk_files: int
    ram_bytes: int = -1  # from /v1/cache/stats (-1: the stats call failed)
    ram_capacity_bytes: int = -1
    disk_bytes: int = -1
    disk_capacity_bytes: int = -1
    conversations: int = -1
    cptree_nodes: int = -1


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0 for a transport error (connection refused, timeout)
    seconds: float
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)


def rss_of(pid: int) -> int:
    """Resident set size of a process: psutil if installed, else /proc (Linux)."""
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def folder_bytes(path: Path) -> tuple[int, int]:
    """Bytes and count of the files under a folder (files vanishing mid-walk are skipped)."""
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                continue
    return total, files


def load_records(corpus: Path, k: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(question, k passages) per record, passages with stable ids shared across records."""
    from ragcache_lab.stream import load_corpus

    loaded = load_corpus(corpus)
    out = []
    for question, ids in zip(loaded.questions, loaded.record_passages, strict=True):
        chunks = [{"id": pid, "text": loaded.passages[pid]} for pid in ids[:k]]
        if chunks:
            out.append((question, chunks))
    if not out:
        raise SystemExit(f"{corpus}: no records with questions and passages")
    return out


def invalid_requests(tenant: str) -> list[tuple[str, str, dict[str, str], bytes | None, dict[str, Any] | None]]:
    """(method, path, headers, raw body, json body) that a correct server answers with a 4xx."""
    hdr = {"X-RagCache-Tenant": tenant}
    return [
        ("POST", "/v1/generate", hdr, b'{"prompt": {"chunks": ["\\ud800"], "question": "q"}}', None),
        ("POST", "/v1/chat/completions", hdr,
         b'{"model": "ragcache", "messages": [{"role": "user", "content": "\\ud800"}], "chunks": ["a"]}', None),
        ("POST", "/v1/generate", hdr, None, {"prompt": {"messages": [{"content": "hi"}], "chunks": []}}),
        ("POST", "/v1/generate", hdr, None, {"prompt": {"chunks": ["a"], "question": ""}}),
        ("POST", "/v1/generate", hdr, b'{"prompt": ', None),
        ("POST", "/v1/generate", hdr, None, {"prompt": {"chunks": ["a"], "question": "q"}, "policy": "nope"}),
        ("POST", "/v1/generate", hdr, None, {"prompt": {"chunks": ["x"] * 1000, "question": "q"}}),
        ("POST", "/v1/generate", hdr, None, {"prompt": {"chunks": ["a"], "question": "q"},
                                             "sampling": {"max_tokens": 0}}),
        ("POST", "/v1/generate", {"X-RagCache-Tenant": "bad tenant!"}, None,
         {"prompt": {"chunks": ["a"], "question": "q"}}),
        ("DELETE", "/v1/cache?all_tenants=true", hdr, None, None),
        ("POST", "/v1/chat/completions", hdr, None, {"model": "ragcache", "messages": [], "max_tokens": 4}),
    ]


class Client:
    """One simulated application: its own tenant share, conversations and random stream."""

    def __init__(self, index: int, base: str, records: list[tuple[str, list[dict[str, str]]]], args: argparse.Namespace,
                 tally: Tally):
        self.index, self.base, self.records, self.args, self.tally = index, base, records, args, tally
        self.rng = random.Random(args.seed * 1000 + index)
        self.tenant = f"soak{index % max(1, args.tenants)}"
        self.http = httpx.Client(base_url=base, timeout=args.request_timeout)
        # Zipf popularity: a few records come back often (their chunks hit), the tail misses
        self.weights = [1.0 / (rank + 1) ** args.zipf for rank in range(len(records))]
        self.conversation: tuple[str, int, int] | None = None  # (id, record, turns so far)
        self.conversations_started = 0

    def record(self) -> tuple[str, list[dict[str, str]]]:
        return self.records[self.rng.choices(range(len(self.records)), self.weights)[0]]

    def body(self, question: str, chunks: list[dict[str, str]], conversation_id: str | None = None) -> dict[str, Any]:
        chunks = list(chunks)
        if self.rng.random() < 0.3:  # the retriever's order varies: fusion has to place chunks anew
            self.rng.shuffle(chunks)
        prompt: dict[str, Any] = {"chunks": chunks, "question": question}
        if conversation_id:
            prompt["conversation_id"] = conversation_id
        return {"prompt": prompt, "sampling": {"max_tokens": self.args.max_tokens},
                "order": self.rng.choice(["preserve", "frequency"]), "tenant": self.tenant}

    def run(self, until: float) -> None:
        kinds, weights = list(MIX), list(MIX.values())
        with self.http:
            while time.monotonic() < until:
                kind = self.rng.choices(kinds, weights)[0]
                started = time.monotonic()
                try:
                    status, detail = getattr(self, f"do_{kind}")()
                except httpx.HTTPError as exc:
                    status, detail = 0, f"{type(exc).__name__}: {exc}"
                self.tally.add(Outcome(kind, status, time.monotonic() - started, detail))

    @staticmethod
    def _detail(response: httpx.Response) -> str:
        return "" if response.status_code < 400 else response.text[:300]

    def do_generate(self) -> tuple[int, str]:
        response = self.http.post("/v1/generate", json=self.body(*self.record()))
        return response.status_code, self._detail(response)

    def do_conversation(self) -> tuple[int, str]:
        if self.conversation is None or self.conversation[2] >= self.args.turns:
            self.conversations_started += 1
            record = self.rng.choices(range(len(self.records)), self.weights)[0]
            self.conversation = (f"c{self.index}-{self.conversations_started}", record, 0)
        cid, record, turns = self.conversation
        # a follow-up brings the next record's passages along with the ones already sent
        question, chunks = self.records[(record + turns) % len(self.records)]
        response = self.http.post("/v1/generate", json=self.body(question, chunks, cid))
        self.conversation = (cid, record, turns + 1)
        return response.status_code, self._detail(response)

    def do_stream(self) -> tuple[int, str]:
        body = {**self.body(*self.record()), "stream": True}
        with self.http.stream("POST", "/v1/generate", json=body) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, self._detail(response)
            event = ""
            for line in response.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event == "error":
                    payload = json.loads(line[5:])
                    return int(payload.get("status", 500)), line[:300]  # a failure after the first token
            return (200, "") if event == "done" else (599, "stream ended without a done event")

    def do_chat(self) -> tuple[int, str]:
        question, chunks = self.record()
        response = self.http.post("/v1/chat/completions", headers={"X-RagCache-Tenant": self.tenant}, json={
            "model": "ragcache", "messages": [{"role": "user", "content": question}], "chunks": chunks,
            "max_tokens": self.args.max_tokens})
        return response.status_code, self._detail(response)

    def do_delete(self) -> tuple[int, str]:
        _, chunks = self.record()
        chunk_id = self.rng.choice(chunks)["id"]
        response = self.http.delete("/v1/cache", params={"chunk_id": chunk_id},
                                    headers={"X-RagCache-Tenant": self.tenant})
        return response.status_code, self._detail(response)

    def do_stats(self) -> tuple[int, str]:
        response = self.http.get("/v1/cache/stats")
        return response.status_code, self._detail(response)

    def do_invalid(self) -> tuple[int, str]:
        method, path, headers, raw, body = self.rng.choice(invalid_requests(self.tenant))
        if raw is not None:
            response = self.http.request(method, path, content=raw,
                                         headers={**headers, "Content-Type": "application/json"})
        else:
            response = self.http.request(method, path, json=body, headers=headers)
        # for an invalid request the body says which check answered; keep it for the report
        return response.status_code, f"{path}: {response.text[:200]}"


def sampler(pid: int, cache_dir: Path, base: str, t0: float, stop: threading.Event, every: float,
            out: list[Sample]) -> None:
    with httpx.Client(base_url=base, timeout=30) as http:
        while True:
            rss = rss_of(pid)
            size, files = folder_bytes(cache_dir)
            sample = Sample(round(time.monotonic() - t0, 2), rss, size, files)
            try:
                stats = http.get("/v1/cache/stats").json()
                for name in ("ram_bytes", "ram_capacity_bytes", "disk_bytes", "disk_capacity_bytes",
                             "conversations", "cptree_nodes"):
                    setattr(sample, name, int(stats.get(name, -1)))
            except (httpx.HTTPError, ValueError):
                pass
            out.append(sample)
            if stop.wait(every):
                return


def _slope_mib_per_min(samples: list[Sample]) -> float:
    if len(samples) < 3:
        return 0.0
    xs = [s.t / 60 for s in samples]
    ys = [s.rss_bytes / MIB for s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def verdict(samples: list[Sample], outcomes: list[Outcome], idle_rss: int, args: argparse.Namespace,
            max_file: int) -> dict[str, Any]:
    ram_budget = int(args.ram_cache_gb * (1 << 30))
    disk_budget = int(args.disk_cache_gb * (1 << 30))
    conv_budget = int(args.conversation_ram_gb * (1 << 30))
    passage_budget = int(getattr(args, "passage_memory_mb", 256.0) * MIB)
    duration = samples[-1].t if samples else 0.0
    warm = [s for s in samples if s.t <= duration * args.warmup]
    after = [s for s in samples if s.t > duration * args.warmup]
    cut = len(after) * 2 // 3
    early, late = after[:cut], after[cut:]
    batch_kv = int(getattr(args, "batch_kv_gb", 4.0) * (1 << 30))
    ceiling = (idle_rss + ram_budget + batch_kv + DISK_WRITE_QUEUE_BYTES + conv_budget + passage_budget
               + args.rss_allowance_mb * MIB)
    peak_after = max((s.rss_bytes for s in after), default=0)
    no_late_growth = (not early or not late
                      or max(s.rss_bytes for s in late) <= max(s.rss_bytes for s in early) * 1.05 + 32 * MIB)
    with_stats = [s for s in samples if s.ram_bytes >= 0]
    server_errors = [o for o in outcomes if o.status >= 500 or o.status == 0]
    valid_4xx = [o for o in outcomes if o.kind != "invalid" and 400 <= o.status < 500 and o.status != 429]
    invalid_ok = [o for o in outcomes if o.kind == "invalid" and 400 <= o.status < 500]
    by_kind: dict[str, Counter[int]] = defaultdict(Counter)
    seconds: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind][o.status] += 1
        if o.status == 200:
            seconds[o.kind].append(o.seconds)
    return {
        "duration_s": duration,
        "requests": len(outcomes),
        "requests_per_s": len(outcomes) / duration if duration else 0.0,
        "by_kind": {k: {str(s): n for s, n in sorted(c.items())} for k, c in sorted(by_kind.items())},
        "latency_s": {k: {"p50": _pct(v, 0.5), "p95": _pct(v, 0.95), "max": max(v)} for k, v in sorted(seconds.items())},
        "server_errors": len(server_errors),
        "server_error_examples": [asdict(o) for o in server_errors[:10]],
        "valid_requests_refused_4xx": len(valid_4xx),
        "valid_4xx_examples": [asdict(o) for o in valid_4xx[:10]],
        "invalid_answered_4xx": f"{len(invalid_ok)}/{sum(1 for o in outcomes if o.kind == 'invalid')}",
        "too_busy_429": sum(1 for o in outcomes if o.status == 429),
        "rss_idle_bytes": idle_rss,
        "rss_warmup_peak_bytes": max((s.rss_bytes for s in warm), default=0),
        "rss_peak_after_warmup_bytes": peak_after,
        "rss_final_bytes": samples[-1].rss_bytes if samples else 0,
        "rss_slope_after_warmup_mib_per_min": round(_slope_mib_per_min(after), 2),
        "rss_peak_early_after_warmup_bytes": max((s.rss_bytes for s in early), default=0),
        "rss_peak_last_third_bytes": max((s.rss_bytes for s in late), default=0),
        "rss_low_early_after_warmup_bytes": min((s.rss_bytes for s in early), default=0),
        "rss_low_last_third_bytes": min((s.rss_bytes for s in late), default=0),
        "rss_ceiling_bytes": ceiling,
        "rss_within_ceiling": peak_after <= ceiling,
        "rss_bounded": bool(after) and no_late_growth,
        "rss_no_late_growth": no_late_growth,
        "ram_budget_bytes": ram_budget,
        "ram_peak_bytes": max((s.ram_bytes for s in with_stats), default=-1),
        "ram_within_budget": bool(with_stats) and all(s.ram_bytes <= s.ram_capacity_bytes for s in with_stats),
        "disk_budget_bytes": disk_budget,
        "disk_folder_peak_bytes": max((s.disk_folder_bytes for s in samples), default=0),
        "disk_folder_final_bytes": samples[-1].disk_folder_bytes if samples else 0,
        "disk_index_peak_bytes": max((s.disk_bytes for s in with_stats), default=-1),
        "disk_largest_file_bytes": max_file,
        "disk_within_budget": bool(samples) and all(s.disk_folder_bytes <= disk_budget + max_file for s in samples)
        and all(s.disk_bytes <= disk_budget for s in with_stats),
        "conversations_peak": max((s.conversations for s in with_stats), default=-1),
        "cptree_nodes_peak": max((s.cptree_nodes for s in with_stats), default=-1),
        "samples": len(samples),
        "stats_failures": len(samples) - len(with_stats),
    }


def _largest_file(path: Path) -> int:
    largest = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                largest = max(largest, os.stat(os.path.join(root, name)).st_size)
            except OSError:
                continue
    return largest


def table(report: dict[str, Any]) -> str:
    v, c = report["verdict"], report["config"]

    def mib(n: int) -> str:
        return f"{n / MIB:,.1f} MiB" if n >= 0 else "n/a"

    lines = [
        f"soak: {c['clients']} clients, {v['duration_s'] / 60:.1f} min, model {c['model']}, "
        f"RAM tier {mib(v['ram_budget_bytes'])}, disk {mib(v['disk_budget_bytes'])}, "
        f"conversations {c['conversations']} / {c['conversation_ram_gb']} GiB",
        "",
        "| measure | value |",
        "|---|---|",
        f"| requests (per s) | {v['requests']:,} ({v['requests_per_s']:.2f}/s) |",
        f"| 5xx or transport errors | {v['server_errors']} |",
        f"| valid requests refused with a 4xx (429 apart) | {v['valid_requests_refused_4xx']} |",
        f"| invalid requests answered 4xx | {v['invalid_answered_4xx']} |",
        f"| 429 (queue full) | {v['too_busy_429']} |",
        f"| RSS idle / warm-up peak / peak after warm-up / final | {mib(v['rss_idle_bytes'])} / "
        f"{mib(v['rss_warmup_peak_bytes'])} / {mib(v['rss_peak_after_warmup_bytes'])} / {mib(v['rss_final_bytes'])} |",
        f"| RSS after warm-up, first two thirds: low / peak | {mib(v.get('rss_low_early_after_warmup_bytes', -1))} / "
        f"{mib(v.get('rss_peak_early_after_warmup_bytes', -1))} |",
        f"| RSS after warm-up, last third: low / peak | {mib(v.get('rss_low_last_third_bytes', -1))} / "
        f"{mib(v.get('rss_peak_last_third_bytes', -1))} |",
        f"| RSS slope after warm-up (least squares; a sawtooth under load) | "
        f"{v['rss_slope_after_warmup_mib_per_min']:+.2f} MiB/min |",
        f"| RSS bound: idle + RAM tier + batch KV + disk write queue + conversations + allowance | "
        f"{mib(v['rss_ceiling_bytes'])} ({'kept' if v.get('rss_within_ceiling', True) else 'PASSED'}) |",
        f"| RAM tier peak (stats) / budget | {mib(v['ram_peak_bytes'])} / {mib(v['ram_budget_bytes'])} |",
        f"| disk folder peak / final / budget (largest file) | {mib(v['disk_folder_peak_bytes'])} / "
        f"{mib(v['disk_folder_final_bytes'])} / {mib(v['disk_budget_bytes'])} ({mib(v['disk_largest_file_bytes'])}) |",
        f"| conversations peak, CP-Tree nodes peak | {v['conversations_peak']}, {v['cptree_nodes_peak']} |",
        f"| samples (stats reads failed) | {v['samples']} ({v['stats_failures']}) |",
        "",
        "| kind | statuses | p50 s | p95 s | max s |",
        "|---|---|---|---|---|",
    ]
    for kind, statuses in v["by_kind"].items():
        lat = v["latency_s"].get(kind, {"p50": 0.0, "p95": 0.0, "max": 0.0})
        lines.append(f"| {kind} | {', '.join(f'{s}: {n}' for s, n in statuses.items())} | {lat['p50']:.2f} | "
                     f"{lat['p95']:.2f} | {lat['max']:.2f} |")
    ok = (v["server_errors"] == 0 and v["ram_within_budget"] and v["disk_within_budget"] and v["rss_bounded"]
          and v.get("rss_within_ceiling", True))
    lines += ["", f"verdict: {'PASS' if ok else 'FAIL'} (no 5xx: {v['server_errors'] == 0}, RAM tier within budget: "
              f"{v['ram_within_budget']}, disk within budget: {v['disk_within_budget']}, RSS bounded: {v['rss_bounded']}, "
              f"RSS within its bound: {v.get('rss_within_ceiling', True)})"]
    return "\n".join(lines)


def run(args: argparse.Namespace, on_started: Callable[[SidecarProcess], None] | None = None) -> dict[str, Any]:
    records = load_records(Path(args.corpus), args.k)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="ragcache-soak-kv-"))
    serve_args = ["--model", args.model, "--cache-dir", str(cache_dir), "--ram-cache-gb", str(args.ram_cache_gb),
                  "--batch-kv-gb", str(args.batch_kv_gb),
                  "--disk-cache-gb", str(args.disk_cache_gb), "--conversations", str(args.conversations),
                  "--conversation-ram-gb", str(args.conversation_ram_gb), "--max-queue", str(args.max_queue),
                  "--passage-memory-mb", str(args.passage_memory_mb),
                  "--request-timeout", str(args.request_timeout), *args.serve_arg]
    if args.threads:
        serve_args += ["--threads", str(args.threads)]
    server = SidecarProcess(out_dir / "server.log", *serve_args, cwd=REPO)
    samples: list[Sample] = []
    tally = Tally()
    try:
        server.start(timeout_s=args.start_timeout)
        assert server.proc is not None
        if on_started is not None:
            on_started(server)
        idle_rss = rss_of(server.proc.pid)
        stop = threading.Event()
        t0 = time.monotonic()
        watcher = threading.Thread(target=sampler, args=(server.proc.pid, cache_dir, server.base, t0, stop,
                                                         args.sample_every, samples), daemon=True)
        watcher.start()
        until = t0 + args.seconds
        clients = [Client(i, server.base, records, args, tally) for i in range(args.clients)]
        threads = [threading.Thread(target=c.run, args=(until,), name=f"soak-client-{c.index}") for c in clients]
        for thread in threads:
            thread.start()
        last = t0
        while any(t.is_alive() for t in threads):
            time.sleep(1.0)
            if args.progress and time.monotonic() - last >= args.progress:
                last = time.monotonic()
                s = samples[-1] if samples else None
                errors = sum(1 for o in tally.outcomes if o.status >= 500 or o.status == 0)
                print(f"[{last - t0:6.0f}s] requests {len(tally.outcomes)}, 5xx {errors}"
                      + (f", RSS {s.rss_bytes / MIB:.0f} MiB, disk {s.disk_folder_bytes / MIB:.1f} MiB,"
                         f" RAM tier {s.ram_bytes / MIB:.1f} MiB" if s else ""), file=sys.stderr, flush=True)
        for thread in threads:
            thread.join()
        stop.set()
        watcher.join(timeout=60)
        max_file = _largest_file(cache_dir)
        alive = server.proc.poll() is None
    finally:
        server_log_tail = server.log_tail(40)
        try:
            server.stop(timeout_s=60)
        except Exception:  # noqa: BLE001 - whatever happened, the child must not outlive the run
            server.kill()
        if not args.cache_dir and not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k not in ("progress", "rejudge")}
    result = verdict(samples, tally.outcomes, idle_rss, args, max_file)
    result["server_alive_at_end"] = alive
    report = {"config": config, "verdict": result, "samples": [asdict(s) for s in samples],
              "outcomes": [asdict(o) for o in tally.outcomes],
              "server_log_tail": server_log_tail, "measured_on": _machine()}
    (out_dir / "soak.json").write_text(json.dumps(report, indent=1))
    (out_dir / "soak.md").write_text(table(report) + "\n")
    return report


def _machine() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                           if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ragcache_lab.soak",
        description=(
            "Start a real `ragcache serve` with small RAM and disk budgets, drive N concurrent clients with a "
            "RAG-like mix (generate, conversations, streamed, chat completions with chunks, deletes, stats, "
            "invalid requests) from a corpus, sample the server's RSS, its cache folder's size and "
            "/v1/cache/stats, and report any 5xx and whether memory and disk stayed within their bounds. "
            "Writes OUT/soak.json (every sample) and OUT/soak.md (the table); exits 1 if the verdict fails."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (one thread and connection each)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=argparse.SUPPRESS,
                        help="how long to drive load (10 unless --seconds)")
    length.add_argument("--seconds", type=float, default=argparse.SUPPRESS, help="the same in seconds (for short runs)")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a local HF model folder")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="musique_s.json-format records (JSON or JSONL)")
    p.add_argument("--k", type=int, default=3, help="passages per request (a record's first k)")
    p.add_argument("--zipf", type=float, default=1.0, help="record popularity skew (0 = uniform)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation")
    p.add_argument("--tenants", type=int, default=2, help="tenants the clients are spread over")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--ram-cache-gb", type=float, default=0.25, help="RAM tier budget (GiB)")
    p.add_argument("--batch-kv-gb", type=float, default=4.0, help="server --batch-kv-gb: KV budget of the running "
                   "requests (GiB), part of the RSS bound")
    p.add_argument("--disk-cache-gb", type=float, default=0.5, help="disk tier budget (GiB)")
    p.add_argument("--conversations", type=int, default=4, help="conversations kept by the server")
    p.add_argument("--conversation-ram-gb", type=float, default=0.5, help="RAM for kept conversations (GiB)")
    p.add_argument("--passage-memory-mb", type=float, default=256.0, help="server --passage-memory-mb: passage "
                   "texts remembered for plain chats (MiB), part of the RSS bound")
    p.add_argument("--max-queue", type=int, default=32, help="server --max-queue (above it: 429, counted apart)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="server and client timeout per request (s)")
    p.add_argument("--threads", type=int, default=0, help="server torch threads (0: torch's choice)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `ragcache serve` (repeat; e.g. --serve-arg=--no-prefetch)")
    p.add_argument("--sample-every", type=float, default=1.0, help="seconds between RSS / disk / stats samples")
    p.add_argument("--warmup", type=float, default=0.3, help="share of the run before RSS is judged")
    p.add_argument("--rss-allowance-mb", type=float, default=768.0,
                   help="RSS allowed above idle + RAM tier + conversation budget (activations, allocator)")
    p.add_argument("--cache-dir", default="", help="disk tier folder (default: a fresh temp folder, removed after)")
    p.add_argument("--keep-cache", action="store_true", help="keep the temp cache folder")
    p.add_argument("--out", default="soak-out", help="folder for soak.json, soak.md and server.log")
    p.add_argument("--seed", type=int, default=0, help="random seed of the clients' streams")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the server to start")
    p.add_argument("--rejudge", default="", metavar="SOAK_JSON",
                   help="print the table of an earlier run's soak.json with the current verdict rules (no load)")
    p.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines on stderr (0: none)")
    return p


def passed(report: dict[str, Any]) -> bool:
    v = report["verdict"]
    return (v["server_errors"] == 0 and v["ram_within_budget"] and v["disk_within_budget"] and v["rss_bounded"]
            and v.get("rss_within_ceiling", True) and v["server_alive_at_end"])


def rejudge(path: Path) -> dict[str, Any]:
    """An earlier run's report with today's verdict rules, from its saved samples and config."""
    report = json.loads(path.read_text())
    args = argparse.Namespace(**{**vars(parser().parse_args([])), **report["config"]})
    samples = [Sample(**s) for s in report["samples"]]
    outcomes = [Outcome(**o) for o in report.get("outcomes", [])]
    old = report["verdict"]
    if not outcomes:  # reports from before outcomes were saved: keep their request counts
        new = verdict(samples, [], old["rss_idle_bytes"], args, old["disk_largest_file_bytes"])
        for key in ("requests", "requests_per_s", "by_kind", "latency_s", "server_errors", "server_error_examples",
                    "valid_requests_refused_4xx", "valid_4xx_examples", "invalid_answered_4xx", "too_busy_429"):
            new[key] = old[key]
    else:
        new = verdict(samples, outcomes, old["rss_idle_bytes"], args, old["disk_largest_file_bytes"])
    new["server_alive_at_end"] = old.get("server_alive_at_end", True)
    report["verdict"] = new
    return report


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rejudge:
        report = rejudge(Path(args.rejudge))
        print(table(report))
        return 0 if passed(report) else 1
    if args.clients < 1:
        parser().error("--clients must be >= 1")
    if getattr(args, "seconds", None) is None:
        args.seconds = 60.0 * getattr(args, "minutes", 10.0)
    args.minutes = args.seconds / 60.0
    report = run(args)
    print(table(report))
    print(f"\nwritten: {Path(args.out) / 'soak.json'}, {Path(args.out) / 'soak.md'}")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
