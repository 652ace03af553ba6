"""User-facing errors: each carries a one-line message that says what to do.

The CLI prints these without a traceback and exits non-zero; the HTTP layer maps them to 4xx.
"""

from __future__ import annotations


class RagCacheError(Exception):
    """Base for errors caused by user input or environment, never by a bug."""

    exit_code = 2
    http_status = 400  # what the HTTP layer answers


class ModelNotFoundError(RagCacheError):
    pass


class UnsupportedModelError(RagCacheError):
    pass


class CorruptModelError(RagCacheError):
    pass


class UnsupportedDtypeError(RagCacheError):
    pass


class PromptTooLongError(RagCacheError):
    http_status = 413


class InvalidPromptError(RagCacheError):
    pass


class InvalidSettingError(RagCacheError):
    """Engine settings that cannot work together (caught when the engine is built)."""


NON_FINITE_MESSAGE = ("the model produced non-finite numbers (NaN or infinity) for this request, so it was stopped "
                      "and none of its KV was kept; retry with policy 'full', or without a ':temp' on the policy")


class NonFiniteLogitsError(RagCacheError):
    """The model's next-token scores hold NaN or +infinity: no token can be chosen from them."""

    http_status = 422


class NonFiniteKVError(RagCacheError):
    """KV with NaN or infinity offered to the chunk store: refused, so no later request reads it."""

    http_status = 422


class EngineUnavailableError(RagCacheError):
    """The engine cannot take requests: it was closed, or its scheduler stopped on a fault."""

    http_status = 503
