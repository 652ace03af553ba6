"""What every route needs: the engine backend, its worker, the metrics, the settings and the
passages the sidecar remembers."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_sidecar.server.backend import ServingBackend
from engine_sidecar.server.metrics import ServerMetrics
from engine_sidecar.server.passage_book import PassageBook
from engine_sidecar.server.settings import ServerSettings
from engine_sidecar.server.worker import EngineWorker
from engine_sidecar.store import warmed_texts
from ragcache_integrations.types import Chunk


@dataclass
class ServerContext:
    backend: ServingBackend
    worker: EngineWorker
    metrics: ServerMetrics
    settings: ServerSettings
    passages: PassageBook = field(init=False)

    def __post_init__(self) -> None:
        self.passages = PassageBook(self.settings.remember_passages, self.settings.passage_memory_bytes)
        store = self.backend.store_facts()
        if store is not None and store.disk_dir is not None:  # what `ragcache warm` computed into this folder
            by_tenant: dict[str, list[Chunk]] = {}
            for tenant, text in warmed_texts.read(store.disk_dir, self.settings.remember_passages * 4):
                by_tenant.setdefault(tenant, []).append(Chunk(text=text))
            for tenant, chunks in by_tenant.items():
                self.passages.remember(chunks, tenant)
