"""`FrequencyOrderPostprocessor`: client-side frequency order of retrieved nodes.

Hot nodes (retrieved most often over the last `window` queries) go first, ties broken by node
id, so the same popular nodes open the prompt in the same order across queries and the engine's
exact chunk-prefix reuse (CP-Tree) hits more often. The engine does the same with
`order="frequency"`; use this instead when the order must also show in `source_nodes`, or with
a backend configured to preserve order. The counts are `ragcache_integrations.access_table`'s,
which LangChain's `ChunkTaggingRetriever` uses too.
"""

from __future__ import annotations

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from ragcache_integrations.access_table import ChunkAccessTable


class FrequencyOrderPostprocessor(BaseNodePostprocessor):
    window: int = Field(default=1000, ge=1, description="How many recent queries the counts cover")

    _table: ChunkAccessTable = PrivateAttr(default_factory=ChunkAccessTable)

    @classmethod
    def class_name(cls) -> str:
        return "FrequencyOrderPostprocessor"

    def count(self, node_id: str) -> int:
        return self._table.count(node_id)

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        self._table.window = self.window  # a field: it may be changed after construction
        return self._table.record_and_sort(nodes, lambda n: n.node.node_id)
