"""The ragcache sidecar: FastAPI over one Engine."""

from engine_sidecar.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
