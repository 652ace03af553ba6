"""`FrequencyOrderPostprocessor`: client-side frequency order of retrieved nodes.

Hot nodes (retrieved most often over the last `window` queries) go first, ties broken by node
id, so the same popular nodes open the prompt in the same order across queries and the engine's
exact chunk-prefix reuse (CP-Tree) hits more often. The engine does the same with
`order="frequency"`; use this instead when the order must also show in `source_nodes`, or with
a backend configured to preserve order.
"""

from __future__ import annotations

import threading
from collections import Counter, deque

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle


class FrequencyOrderPostprocessor(BaseNodePostprocessor):
    window: int = Field(default=1000, ge=1, description="How many recent queries the counts cover")

    _recent: deque[list[str]] = PrivateAttr(default_factory=deque)
    _counts: Counter[str] = PrivateAttr(default_factory=Counter)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "FrequencyOrderPostprocessor"

    def count(self, node_id: str) -> int:
        return self._counts[node_id]

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        ids = list(dict.fromkeys(n.node.node_id for n in nodes))
        with self._lock:
            self._recent.append(ids)
            self._counts.update(ids)
            while len(self._recent) > self.window:
                self._counts.subtract(self._recent.popleft())
            counts = dict(self._counts)
        return sorted(nodes, key=lambda n: (-counts.get(n.node.node_id, 0), n.node.node_id))
