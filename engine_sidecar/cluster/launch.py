"""`ragcache serve --replicas N`: the flags, and serving until SIGTERM/SIGINT. argparse only at
import time; Ray is imported when a cluster actually starts."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from engine_sidecar.engine_args import positive_int


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve; needs the cluster extra: pip install 'ragcache[cluster]')")
    g.add_argument("--replicas", type=positive_int, default=1,
                   help="engine replicas behind Ray Serve's HTTP proxy, routed on chunk residency (default 1: "
                        "no Ray, one process)")
    g.add_argument("--ray-address", default=None,
                   help="join an existing Ray cluster (e.g. ray://head:10001 or auto) instead of starting a "
                        "single-machine Ray")
    g.add_argument("--router", choices=["affinity", "round-robin"], default="affinity",
                   help="how requests pick a replica: affinity (chunk residency + queue, default) or round-robin")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray CPUs reserved per replica (placement on a cluster; default 1)")


def wants_cluster(args: argparse.Namespace) -> bool:
    return getattr(args, "replicas", 1) > 1 or bool(getattr(args, "ray_address", None))


def replica_threads(args: argparse.Namespace) -> int:
    """torch threads per replica: --threads, else the machine's CPUs shared out (a local Ray runs
    every replica here; N replicas each taking all cores would thrash)."""
    if args.threads:
        return int(args.threads)
    return max(1, (os.cpu_count() or 1) // args.replicas)


def serve_cluster(args: argparse.Namespace) -> int:
    from engine_sidecar.model.prepare import resolve_model_dir
    from engine_sidecar.server.serve_args import settings_from_args

    try:
        from engine_sidecar.cluster import ray_app
    except ImportError as exc:
        raise SystemExit(f"ragcache: error: --replicas needs Ray Serve ({exc}); pip install 'ragcache[cluster]'") from None
    model_dir = resolve_model_dir(args.model)  # prepared once here, not raced by N replicas
    settings = settings_from_args(args, model_dir.name)
    engine_args = argparse.Namespace(**{**vars(args), "model": str(model_dir), "threads": replica_threads(args),
                                        "func": None})
    port = args.port or 8808  # Serve's proxy needs a fixed port
    ray_app.run(engine_args, settings, args.replicas, args.host, port, router=args.router,
                replica_cpus=args.replica_cpus, address=args.ray_address)
    redis = f", Redis {args.redis_url}" if args.redis_url else ", no Redis (replicas share nothing)"
    print(f"ragcache serving on http://{args.host}:{port} | {args.replicas} replicas on Ray Serve "
          f"({args.ray_address or 'local Ray'}) | router {args.router} | model {model_dir} | "
          f"{engine_args.threads} torch threads each{redis}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        time.sleep(0.5)
    from ray import serve

    serve.shutdown()  # replicas close their engines (disk tiers flushed)
    return 0
