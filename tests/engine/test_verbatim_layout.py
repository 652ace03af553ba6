"""Verbatim layout: the app's own chat messages with chunks marked where they are quoted.

What drop-in framework adapters rely on: the tokens computed are exactly the plain chat's, so
policy `full` answers like a plain chat, and reused chunks still hit."""

from __future__ import annotations

import pytest

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.request.prompt import core_bounds
from ragcache_integrations import ChunkedPrompt
from ragcache_integrations.types import Chunk

A = "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean."
B = "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres."


def messages(question: str = "Which river reaches the Atlantic?", first: str = A, second: str = B) -> list[dict]:
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n---\n{first}\n\n{second}\n---\nQuery: {question}\nAnswer: "}]


def verbatim(msgs: list[dict], chunks=(A, B)) -> ChunkedPrompt:
    return ChunkedPrompt(messages=msgs, chunks=[Chunk(text=t) for t in chunks])


def test_tokens_are_the_plain_chat_tokens_cut_at_the_chunks(tiny_engine):
    msgs = messages()
    assembled = tiny_engine.builder.build(verbatim(msgs))
    assert assembled.token_ids == list(tiny_engine.builder.build_chat(msgs).token_ids)
    kinds = [s.kind for s in assembled.segments]
    assert kinds == ["prefix", "chunk", "separator", "chunk", "question"]
    decoded = [tiny_engine.builder.decode(list(s.token_ids)).strip() for s in assembled.segments if s.kind == "chunk"]
    # each chunk is cached under its core: the first and last words join the text around them
    assert decoded == [text.strip()[slice(*core_bounds(text.strip()))].strip() for text in (A, B)]


def test_policy_full_answers_exactly_like_the_plain_chat(tiny_engine):
    msgs = messages()
    plain = "".join(tiny_engine.stream_chat(msgs, {"max_tokens": 12}))
    full = tiny_engine.generate(verbatim(msgs), {"max_tokens": 12}, policy="full")
    assert full.text == plain
    ref, _ = tiny_engine.prefill_logits(verbatim(msgs), policy="full")
    blended, _ = tiny_engine.prefill_logits(verbatim(msgs), policy="cacheblend:1.0")
    assert (ref - blended).abs().max().item() <= 1e-4


def test_quoted_chunks_are_reused_across_prompts_and_orders(tiny_engine):
    tiny_engine.generate(verbatim(messages()), {"max_tokens": 2}, tenant="t-verbatim")
    swapped = verbatim(messages("Where is Kilimanjaro?", first=B, second=A), chunks=(B, A))
    again = tiny_engine.generate(swapped, {"max_tokens": 2}, tenant="t-verbatim")
    assert again.stats.chunk_hits == 2 and again.stats.tokens_reused > 0
    other_tenant = tiny_engine.generate(swapped, {"max_tokens": 2}, tenant="t-other")
    assert other_tenant.stats.chunk_hits == 0


def test_no_chunks_is_a_plain_chat_with_a_reusable_prefix(tiny_engine):
    msgs = messages()
    prompt = ChunkedPrompt(messages=msgs)
    assert prompt.question == ""
    assembled = tiny_engine.builder.build(prompt)
    assert [s.kind for s in assembled.segments] == ["prefix", "question"]
    assert tiny_engine.generate(prompt, {"max_tokens": 8}, policy="full").text == "".join(
        tiny_engine.stream_chat(msgs, {"max_tokens": 8}))


@pytest.mark.parametrize("chunks, needle", [
    (("A passage that the messages never quote.",), "chunks[0].text does not occur in"),
    ((B, A), "chunks[1].text does not occur after the previous chunk"),
])
def test_chunks_not_quoted_in_order_are_clear_errors(tiny_engine, chunks, needle):
    with pytest.raises(InvalidPromptError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        tiny_engine.generate(verbatim(messages(), chunks), {"max_tokens": 2})


def test_empty_messages_are_a_clear_error(tiny_engine):
    with pytest.raises(InvalidPromptError, match="messages is empty"):
        tiny_engine.generate(ChunkedPrompt(messages=[]), {"max_tokens": 2})


def test_a_conversations_next_turn_reuses_its_history_exactly(tiny_engine):
    """Chat engines re-send the whole chat each turn: with a conversation_id the earlier turns'
    KV (as far as the template re-renders them identically) is reused, and the logits equal a
    full prefill of the whole chat."""
    first = messages()
    turn1 = tiny_engine.generate(ChunkedPrompt(messages=first, chunks=[Chunk(text=A), Chunk(text=B)],
                                               conversation_id="c1"), {"max_tokens": 6}, policy="prefix")
    second = [*first, {"role": "assistant", "content": turn1.text},
              {"role": "user", "content": "And which mountain is the highest in Africa?"}]
    prompt = ChunkedPrompt(messages=second, chunks=[Chunk(text=A), Chunk(text=B)], conversation_id="c1")
    full, _ = tiny_engine.prefill_logits(ChunkedPrompt(messages=second), policy="full")
    reused, stats = tiny_engine.prefill_logits(prompt, policy="prefix")
    history = stats.plan[0]
    assert history["kind"] == "history" and history["mode"] == "exact"
    assert history["positions"][1] > len(tiny_engine.builder.build(ChunkedPrompt(messages=first)).token_ids) // 2
    assert stats.tokens_reused >= history["positions"][1]
    assert (full - reused).abs().max().item() <= 1e-4
    other = tiny_engine.generate(ChunkedPrompt(messages=second, conversation_id="c1"), {"max_tokens": 2},
                                 policy="prefix", tenant="someone-else")
    assert other.stats.plan[0]["kind"] != "history"  # conversations are per tenant


def test_frequency_order_leaves_a_verbatim_prompt_as_written(tiny_engine):
    for _ in range(3):
        tiny_engine.generate(verbatim(messages("Where is Kilimanjaro?", first=B, second=A), chunks=(B, A)),
                             {"max_tokens": 1})
    result = tiny_engine.generate(verbatim(messages()), {"max_tokens": 1}, order="frequency")
    assert [s["chunk_id"] for s in result.stats.plan if s["kind"] == "chunk"] == [Chunk(text=A).id, Chunk(text=B).id]


def test_exact_chunk_paths_include_the_text_between_chunks(tiny_llama_dir, tmp_path):
    from engine_sidecar import Engine

    with Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                promote_threshold=1) as engine:
        for _ in range(3):  # the path [A, B] is promoted and stored exactly
            stats = engine.generate(verbatim(messages()), {"max_tokens": 1}, policy="prefix").stats
        assert [s["mode"] for s in stats.plan if s["kind"] == "chunk"] == ["exact", "exact"]
        # the same chunks with other text between them: B's stored KV saw other tokens before it
        other = [{"role": "system", "content": "Answer from the context."},
                 {"role": "user", "content": f"Context:\n---\n{A}\n\nAND ALSO\n\n{B}\n---\nQuery: Which?\nAnswer: "}]
        stats = engine.generate(verbatim(other), {"max_tokens": 1}, policy="prefix").stats
        assert [s["mode"] for s in stats.plan if s["kind"] == "chunk"] == ["exact", "fresh"]


def test_edge_names_keep_separator_and_chunk_apart():
    """A separator [5] before chunk [7] is another edge than chunk [5, 7] with nothing between:
    their stored KV has different lengths."""
    from engine_sidecar.request.prompt import Segment
    from engine_sidecar.reuse.planner import edge_digests

    with_separator = edge_digests([Segment("prefix", (1,)), Segment("separator", (5,)), Segment("chunk", (7,), "b")])
    joined = edge_digests([Segment("prefix", (1,)), Segment("chunk", (5, 7), "b")])
    plain = edge_digests([Segment("prefix", (1,)), Segment("chunk", (7,), "b")])
    assert len({with_separator[0], joined[0], plain[0]}) == 3


TEMPLATES = {  # how RAG frameworks quote retrieved passages
    "llama_index": "Context information is below.\n---------------------\n{ctx}\n---------------------\nQuery: {q}\n"
                   "Answer: ",
    "rag_prompt": "Use the following pieces of retrieved context to answer the question.\nQuestion: {q} \n"
                  "Context: {ctx} \nAnswer:",
    "stuff": "Answer using the context:\n\n{ctx}\n\nQuestion: {q}",
}
PASSAGES = [A, B, "  Exeter College, Oxford is a constituent college of the University of Oxford.\n",
            "北京是中华人民共和国的首都。它位于华北平原，是全国的政治中心。也是文化中心。",
            '(1) "Quoted" text, with dashes - and numbers 12345.67 at the end!']


def tokenizer_dirs(smol_dir) -> list:
    """SmolLM2's (GPT-2 style BPE) always; Qwen2.5's (tiktoken-style regex) and Gemma 3's
    (SentencePiece BPE) where `ragcache model prepare --registry` has put them on this machine."""
    from engine_sidecar.model.registry import registry_dir

    return [smol_dir] + [registry_dir(name) for name in ("qwen2.5-coder-0.5b", "gemma3-270m")
                         if (registry_dir(name) / "tokenizer.json").is_file()]


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_passage_core_is_the_same_tokens_in_both_layouts(smol_dir, template):
    from engine_sidecar.request.prompt import PromptBuilder

    for folder in tokenizer_dirs(smol_dir):
        builder = PromptBuilder.load(folder)
        chunks = [Chunk(text=t, id=str(i)) for i, t in enumerate(PASSAGES)]
        text = TEMPLATES[template].format(ctx="\n\n".join(p.strip() for p in PASSAGES), q="Who?")
        msgs = [{"role": "user", "content": text}]
        assembled = builder.build(ChunkedPrompt(messages=msgs, chunks=chunks))
        assert assembled.token_ids == list(builder.build_chat(msgs).token_ids)
        quoted = {s.chunk_id: s.token_ids for s in assembled.segments if s.kind == "chunk"}
        for chunk in chunks:
            core = builder.chunk_segment(chunk).token_ids
            assert core and quoted[chunk.id] == core, (folder.name, template, chunk.text)
        engine_layout = builder.build(ChunkedPrompt(chunks=chunks, question="Who?"))
        whole = [builder.encode(c.text.strip() + "\n\n") for c in chunks]
        passages_ids = [t for s in engine_layout.segments[1:-1] for t in s.token_ids]
        assert passages_ids == [t for ids in whole for t in ids]  # the layout's tokens are unchanged


def test_a_one_word_passage_has_no_core_and_is_computed_with_the_request(tiny_engine):
    assembled = tiny_engine.builder.build(ChunkedPrompt(chunks=["Paris", A], question="Where?"))
    assert [s.chunk_id is not None for s in assembled.segments if s.kind == "chunk"] == [True]
    result = tiny_engine.generate(ChunkedPrompt(chunks=["Paris", A], question="Where?"), {"max_tokens": 2})
    assert result.stats.chunk_hits + result.stats.chunk_misses == 1 and result.text is not None
