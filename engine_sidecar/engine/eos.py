"""The token ids that end an answer: the model config's, the tokenizer's, and the chat end
markers the common templates close a turn with (a template may end a turn with a token the
config does not list as eos)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported where the tokenizer is loaded, not here
    from transformers import PreTrainedTokenizerBase

END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>")


def eos_token_ids(model_eos: Iterable[int], tok: PreTrainedTokenizerBase) -> set[int]:
    ids = set(model_eos)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    for name in END_MARKERS:
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id and name in tok.get_vocab():
            ids.add(tid)
    return ids
