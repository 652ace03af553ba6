"""The ragcache sidecar: FastAPI over one Engine (see docs/api.md).

Imported lazily so `ragcache --help` and the CLI's argument parsing never load fastapi.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_sidecar.server.app import create_app
    from engine_sidecar.server.settings import ServerSettings


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from engine_sidecar.server.app import create_app

        return create_app
    if name == "ServerSettings":
        from engine_sidecar.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(name)


__all__ = ["ServerSettings", "create_app"]
