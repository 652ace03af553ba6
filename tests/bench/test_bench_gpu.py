"""`ragcache bench gpu` as a dry run on the CPU (tiny shapes): every section runs and reports, the
guards pass, the table names the machine, and it runs without fastapi, uvicorn or rich (the GPU
machines' image has none of them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_sidecar.cli.main import main
from ragcache_lab.gpu import GRAPH_POLICIES, GRAPHS_SUFFIX, HOST_TIER_ROW, POLICIES

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_reports_every_section(smol_dir, tmp_path, capsys):
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--tokenizer", str(smol_dir), "--out", str(out)]) == 0
    report = json.loads((out / "bench-gpu.json").read_text())
    assert report["machine"]["device"] == "cpu" and report["machine"]["name"]
    assert report["peaks"]["bandwidth_gb_s"] > 0 and report["peaks"]["matmul_tflop_s"] > 0
    assert "CUDA" in report["kernels"]["skipped"]
    guards = report["guards"]
    assert guards["pass"] and guards["full_vs_transformers_argmax_equal"], guards
    # each other family's small model through the engine on this device, against transformers
    assert set(guards["families"]) == {"qwen3", "qwen3_moe", "gemma3_text"}
    assert all(row["pass"] and row["full_vs_transformers_argmax_equal"] for row in guards["families"].values())
    # decode from the block pool (one sequence in its own buffer beside) against buffers alone
    assert guards["block_pool_decode"]["pass"] and guards["block_pool_decode"]["same_tokens"]
    assert guards["block_pool_decode"]["max_abs"] < 1e-3  # fp32 on a CPU
    tiers = guards["tiers"]
    assert tiers["host_round_trip_equal"] and tiers["disk_copy_equal"]
    assert (tiers["host_hits"], tiers["host_demotions"]) == (1, 2)  # the second moves out for the first
    ttft = report["ttft_tiny"]
    graph_rows = {f"{policy} {GRAPHS_SUFFIX}" for policy in GRAPH_POLICIES}
    assert set(ttft["policies"]) == {*POLICIES, *graph_rows, HOST_TIER_ROW} and ttft["tokens"] > 100
    # the same prompts with prefill graphs asked for: on a CPU nothing replays (they need CUDA),
    # so these rows run the op-by-op path again and reuse the same chunks
    assert all(ttft["policies"][row]["graph_replays"] == 0 for row in graph_rows)
    assert ttft["policies"][f"reuse {GRAPHS_SUFFIX}"]["chunk_hits"] == 3
    from_host = ttft["policies"][HOST_TIER_ROW]
    # the passages and the template prefix before them all come from the host tier
    assert from_host["host_tier_hits"] >= from_host["chunk_hits"] == 3
    assert all(row["ttft_ms"] > 0 for row in ttft["policies"].values())
    assert ttft["policies"]["full"]["chunk_hits"] == 0 and ttft["policies"]["reuse"]["chunk_hits"] == 3
    assert ttft["policies"]["reuse"]["computed_fraction"] < ttft["policies"]["full"]["computed_fraction"]
    assert all(ttft["policies"][name]["launches"] > 0 for name in POLICIES)
    assert ttft["transformers_full_ms"] > 0 and ttft["floor_weights_read_ms"] > 0 and ttft["floor_full_prefill_ms"] > 0
    decode = report["decode_tiny"]
    assert decode["1"]["output_tokens"] == 4 and decode["2"]["output_tokens"] == 8
    pooled = report["decode_tiny_block_pool"]  # the same load with the KV in the block pool
    assert pooled["kv_block_size"] == 16 and pooled["2"]["output_tokens"] == 8
    http = report["http_tiny"]  # the sidecar's own app, clients streaming over a loopback port
    assert [(http[c]["requests"], http[c]["errors"], http[c]["output_tokens"]) for c in ("1", "2")] == [(1, 0, 4),
                                                                                                      (2, 0, 8)]
    assert all(0 < http[c]["ttft_p50_s"] <= http[c]["ttft_p99_s"] and http[c]["output_tokens_per_s"] > 0
               for c in ("1", "2"))
    table = (out / "bench-gpu.md").read_text()
    assert "HTTP, tiny shape: streamed `/v1/generate`, 2 stored passages" in table
    assert report["machine"]["name"] in table and "| full | reuse |" in table and "floor tokens/s" in table
    assert "KV in a block pool of 16-row blocks" in table
    assert "host tier round trip exact, disk copy exact" in table
    assert f"Launches per request (aten ops, views excluded): full {ttft['policies']['full']['launches']}" in table
    assert table.strip() in capsys.readouterr().out


@pytest.mark.parametrize("flag,value,message", [("--shapes", "huge", "unknown huge"),
                                                ("--concurrency", "0", "--concurrency"),
                                                ("--repeats", "-1", "--repeats"),
                                                ("--http-clients", "2,x", "--http-clients"),
                                                ("--http-clients", "0,2", "--http-clients"),
                                                ("--http-policy", "cacheblend:2", "--http-policy")])
def test_bad_flags_are_one_line_before_any_work(tmp_path, capsys, flag, value, message):
    assert main(["bench", "gpu", "--device", "cpu", "--quick", flag, value, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "bench-gpu.json").exists()


def test_it_runs_without_the_server_stack(smol_dir, tmp_path):
    # on the bundled sample passages, as in a clone without ../shared/data beside it
    bundled = str(ROOT / "examples" / "data" / "demo.json")
    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'rich', 'starlette'):\n"
            "    sys.modules[name] = None  # importing any of them now fails\n"
            "from ragcache_lab.gpu import main\n"
            f"raise SystemExit(main(['--device', 'cpu', '--quick', '--tokenizer', {str(smol_dir)!r}, "
            f"'--out', {str(tmp_path)!r}, '--concurrency', '1', '--data', {bundled!r}]))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench-gpu.json").read_text())
    assert not [k for k, v in report.items() if isinstance(v, dict) and "error" in v], report
    # the HTTP and serve sections alone need the server stack, and say so rather than failing
    assert "server extra" in report["http_tiny"]["skipped"] and "server extra" in report["serve_tiny"]["skipped"]
    table = (tmp_path / "bench-gpu.md").read_text()
    assert "HTTP, tiny shape: skipped: needs the server extra" in table
    assert "Serve, tiny shape: skipped: needs the server extra" in table


def test_the_flags_name_every_shape_the_benchmark_has():
    from ragcache_lab.gpu import SHAPES
    from ragcache_lab.gpu_args import SHAPE_NAMES

    assert SHAPE_NAMES == tuple(SHAPES)


def test_sections_and_a_profile_run_only_what_was_asked(smol_dir, tmp_path):
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--tokenizer", str(smol_dir), "--out", str(out),
                 "--sections", "ttft", "--profile", "reuse"]) == 0
    report = json.loads((out / "bench-gpu.json").read_text())
    assert {"peaks", "ttft_tiny"} <= set(report) and not {"kernels", "guards", "decode_tiny", "http_tiny",
                                                                      "serve_tiny"} & set(report)
    profile = (out / "profile-tiny.txt").read_text()
    # torch.profiler's operators, then cProfile's Python functions of the same request
    assert profile.startswith("=== reuse, tiny shape") and "aten::" in profile
    assert "cProfile, 5 calls, by own time" in profile and "fused_prefill" in profile


def test_an_unknown_section_is_one_line(tmp_path, capsys):
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--sections", "ttft,speed", "--out", str(tmp_path)]) == 2
    assert "--sections: unknown speed" in capsys.readouterr().err


def test_host_syncs_count_the_callers_thread_only():
    """Sync debug mode is process-wide: a writer thread's wait meanwhile is not the request's."""
    import threading
    import warnings

    from ragcache_lab.gpu_counts import host_sync_sites, site_counts

    modes: list[str] = []

    def request() -> None:
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        writer = threading.Thread(target=lambda: warnings.warn("called a synchronizing CUDA operation", stacklevel=1))
        writer.start()
        writer.join()
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("an unrelated warning", stacklevel=1)

    sites = host_sync_sites(request, debug_mode=modes.append)
    assert modes == ["warn", "default"]
    assert len(sites) == 2 and all(s.endswith(tuple(f":{n}" for n in range(1, 10000))) for s in sites)
    assert list(site_counts(sites).values()) == [1, 1]


def test_the_first_sync_is_reported_with_the_calls_above_it():
    from ragcache_lab.gpu_counts import first_sync_stack

    modes: list[str] = []

    def reads_back() -> None:
        raise RuntimeError("called a synchronizing CUDA operation")

    def caller() -> None:
        reads_back()

    stack = first_sync_stack(caller, debug_mode=modes.append)
    assert modes == ["error", "default"] and stack is not None
    assert [line.split()[-1] for line in stack.splitlines()][-2:] == ["caller", "reads_back"]
    assert first_sync_stack(lambda: None, debug_mode=modes.append) is None


def test_the_timeline_finds_the_device_idle_while_the_host_works():
    """The profiler's CUDA records cannot be made without a GPU: records of the same shape. Two
    overlapping kernels (150-260 µs) and two after a 240 µs wait, during which the host was in a
    matmul and a graph launch; a 5 µs gap is under the 20 µs threshold."""
    from types import SimpleNamespace as Record

    import torch

    from ragcache_lab.gpu_counts import timeline

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def record(device, start, end, name):
        return Record(device_type=device, time_range=Record(start=start, end=end), name=name, cpu_parent=None)

    events = [record(cpu, 0, 100, "plan"), record(cpu, 100, 300, "aten::mm"), record(cpu, 300, 900, "cudaGraphLaunch"),
              record(cuda, 150, 200, "k1"), record(cuda, 190, 260, "k2"), record(cuda, 500, 800, "k3"),
              record(cuda, 805, 850, "k4")]
    lines = timeline(events).splitlines()
    assert lines[0] == ("timeline (µs from the first host op): device starts at 150, ends at 850; busy 455, "
                        "idle 245 (1 gaps over 20 µs)")
    assert lines[1] == "  gap 240 µs at 260: host ran aten::mm, cudaGraphLaunch"
    assert timeline([record(cpu, 0, 1, "plan")]) == "timeline: no device work recorded"
