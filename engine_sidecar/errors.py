"""User-facing errors: each carries a one-line message that says what to do.

The CLI prints these without a traceback and exits non-zero; the HTTP layer maps them to 4xx.
"""

from __future__ import annotations


class RagCacheError(Exception):
    """Base for errors caused by user input or environment, never by a bug."""

    exit_code = 2


class ModelNotFoundError(RagCacheError):
    pass


class UnsupportedModelError(RagCacheError):
    pass


class CorruptModelError(RagCacheError):
    pass


class UnsupportedDtypeError(RagCacheError):
    pass


class PromptTooLongError(RagCacheError):
    pass


class InvalidPromptError(RagCacheError):
    pass
