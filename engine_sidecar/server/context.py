"""What every route needs: the engine backend, its worker, the metrics, the settings and the
passages the sidecar remembers."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_sidecar.server.backend import ServingBackend
from engine_sidecar.server.metrics import ServerMetrics
from engine_sidecar.server.passage_book import PassageBook
from engine_sidecar.server.settings import ServerSettings
from engine_sidecar.server.worker import EngineWorker


@dataclass
class ServerContext:
    backend: ServingBackend
    worker: EngineWorker
    metrics: ServerMetrics
    settings: ServerSettings
    passages: PassageBook = field(init=False)

    def __post_init__(self) -> None:
        self.passages = PassageBook(self.settings.remember_passages)
