"""How the drop-in LLM learns which passages the current query retrieved: LlamaIndex instrumentation.

Two hooks on the root dispatcher feed the process-wide `ChunkRegistry`:
- `RetrievalEndEvent`: every retriever's nodes, with their node ids;
- the `synthesize` span of any response synthesizer: the nodes after postprocessing (a
  postprocessor may replace a node's text, e.g. sentence-window metadata replacement), read from
  the span's bound arguments.
Both register a node under the text the default synthesizers put into prompts
(`get_content(metadata_mode=LLM)`) and under its bare text, both with the node id.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from ragcache_integrations.recovery import REGISTRY, ChunkRegistry

_installed = False
_install_lock = threading.Lock()


def node_text(node: BaseNode) -> str:
    """The text LlamaIndex's synthesizers put into a prompt for this node."""
    return node.get_content(metadata_mode=MetadataMode.LLM)


def remember_nodes(nodes: Iterable[NodeWithScore | BaseNode] | None, registry: ChunkRegistry = REGISTRY) -> None:
    for item in nodes or ():
        node = item.node if isinstance(item, NodeWithScore) else item
        if not isinstance(node, BaseNode):
            continue
        bare = node.get_content(metadata_mode=MetadataMode.NONE)
        if bare:
            registry.add(bare, node.node_id)
        full = node_text(node)
        if full and full != bare:
            registry.add(full, node.node_id)


class RetrievalObserver(BaseEventHandler):
    @classmethod
    def class_name(cls) -> str:
        return "RagCacheRetrievalObserver"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            remember_nodes(event.nodes)


class SynthesisObserver(BaseSpanHandler[Any]):
    """Reads the nodes a synthesizer was given; keeps no spans (the base class would store them)."""

    @classmethod
    def class_name(cls) -> str:
        return "RagCacheSynthesisObserver"

    def span_enter(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                   parent_id: str | None = None, tags: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if isinstance(instance, BaseSynthesizer):
            remember_nodes(bound_args.arguments.get("nodes"))

    def new_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                 parent_span_id: str | None = None, tags: dict[str, Any] | None = None, **kwargs: Any) -> None:
        return None

    def prepare_to_exit_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                             result: Any | None = None, **kwargs: Any) -> None:
        return None

    def prepare_to_drop_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                             err: BaseException | None = None, **kwargs: Any) -> None:
        return None


def install() -> None:
    """Attach the observers to LlamaIndex's root dispatcher, once per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        root = get_dispatcher()
        root.add_event_handler(RetrievalObserver())
        root.add_span_handler(SynthesisObserver())
        _installed = True
