"""What every route needs: the engine, its worker, the metrics and the settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_sidecar.server.metrics import ServerMetrics
from engine_sidecar.server.settings import ServerSettings
from engine_sidecar.server.worker import EngineWorker

if TYPE_CHECKING:
    from engine_sidecar.engine import Engine


@dataclass
class ServerContext:
    engine: Engine
    worker: EngineWorker
    metrics: ServerMetrics
    settings: ServerSettings
