"""What every route needs: the engine backend, its worker, the metrics and the settings."""

from __future__ import annotations

from dataclasses import dataclass

from engine_sidecar.server.backend import ServingBackend
from engine_sidecar.server.metrics import ServerMetrics
from engine_sidecar.server.settings import ServerSettings
from engine_sidecar.server.worker import EngineWorker


@dataclass
class ServerContext:
    backend: ServingBackend
    worker: EngineWorker
    metrics: ServerMetrics
    settings: ServerSettings
