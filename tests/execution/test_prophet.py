"""prophet: question-driven multi-layer selection. Scores and windows on hand-computed cases, the
probe against the question's attention in a real `reuse` pass, the budget and the token-layer
count, the ratio-1.0 guard (== full prefill, also teacher-forced), and the grammar in the API."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.policies import (
    PrefillView,
    ProphetPolicy,
    ReusePolicy,
    parse_policy,
    span_masks,
)
from engine_sidecar.execution.question_probe import (
    attention_scores,
    probe_attention,
    probe_scores,
    reader_mask,
    select_with_windows,
)
from ragcache_integrations import ChunkedPrompt
from ragcache_integrations.policy_registry import PolicySpecError, parse_policy_spec
from ragcache_kernels.attention import selective_attention
from ragcache_kernels.rope import apply_rope
from tests.policy_prompt import PASSAGES, QUESTION, plan_of


def test_attention_scores_by_hand_each_head_normalized_over_fused_keys():
    # one reader at position 3; 2 heads, 2 KV heads, D = 1 (scale 1); key 0 is not fused.
    # head 0: logits [0, ln2, 0, 0] -> probs [1, 2, 1, 1] / 5 -> on fused keys [2, 1, 1] / 4
    # head 1: logits [0, 0, 0, ln3] -> probs [1, 1, 1, 3] / 6 -> on fused keys [1, 1, 3] / 5
    q = torch.ones(1, 2, 1)
    k = torch.tensor([[0.0, 0.0], [math.log(2), 0.0], [0.0, 0.0], [0.0, math.log(3)]]).unsqueeze(-1)
    fused = torch.tensor([False, True, True, True])
    scores = attention_scores(q, k, torch.tensor([3]), torch.arange(4), fused)
    expected = torch.tensor([0.0, (0.5 + 0.2) / 2, (0.25 + 0.2) / 2, (0.25 + 0.6) / 2])
    assert torch.allclose(scores, expected, atol=1e-6)


def test_a_head_that_barely_looks_at_the_fused_keys_still_gets_an_equal_vote():
    # head 0 sends almost all its mass to key 0 (not fused) and the rest to key 1; head 1 spreads
    # evenly over keys 1 and 2. Raw mass would rank key 2 first; per-head normalization ties
    # key 1 (0.5 + 1.0 / 2) above key 2 (0.5 / 2).
    q = torch.ones(1, 2, 1)
    k = torch.tensor([[20.0, 0.0], [0.0, 0.0], [-50.0, 0.0]]).unsqueeze(-1)
    fused = torch.tensor([False, True, True])
    scores = attention_scores(q, k, torch.tensor([2]), torch.arange(3), fused)
    assert torch.allclose(scores, torch.tensor([0.0, 0.75, 0.25]), atol=1e-5)


def test_keys_after_the_reader_are_not_visible():
    q = torch.ones(1, 1, 1)
    k = torch.zeros(3, 1, 1)
    scores = attention_scores(q, k, torch.tensor([1]), torch.arange(3), torch.tensor([True, True, True]))
    assert torch.allclose(scores, torch.tensor([0.5, 0.5, 0.0]))


@pytest.mark.parametrize("window", [None, 5])
def test_probe_attention_is_the_attention_and_the_readers_scores(window):
    """One softmax gives both: the output equals the torch reference attention of every probed
    token, the scores equal `attention_scores` of the reader rows alone (GQA, gapped positions)."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim = 23, 6, 2, 8
    k = torch.randn(n, kv_heads, dim, generator=gen)
    v = torch.randn(n, kv_heads, dim, generator=gen)
    query_pos = torch.tensor([4, 9, 17, 20, 22])
    q = torch.randn(query_pos.shape[0], heads, dim, generator=gen) * 2
    readers = torch.tensor([False, True, False, True, True])
    fused = torch.arange(n) % 3 != 0
    scores, out = probe_attention(q, k, v, query_pos, torch.arange(n), readers, fused, window)
    expected = selective_attention(q, k, v, query_pos, torch.arange(n), window)
    assert torch.allclose(out, expected, atol=1e-5)
    alone = attention_scores(q[readers], k, query_pos[readers], torch.arange(n), fused, window)
    assert torch.allclose(scores, alone, atol=1e-6)
    assert abs(scores.sum().item() - 1.0) < 1e-5 and scores[~fused].abs().max().item() == 0.0


def test_windows_by_hand():
    scores = torch.tensor([0.0, 0.1, 0.9, 0.2, 0.3, 0.8, 0.0, 0.05])
    candidates = torch.tensor([False, True, True, True, True, True, True, True])
    segments = [(1, 5), (5, 8)]
    # radius 0: plain top-3 -> 2, 5, 4
    plain = select_with_windows(scores, candidates, 3, 0, segments)
    assert plain.nonzero().squeeze(1).tolist() == [2, 4, 5]
    # radius 1, budget 5: pick 2 with 1 and 3; pick 5 with 6 (4 is in the other segment) -> 5 tokens
    windowed = select_with_windows(scores, candidates, 5, 1, segments)
    assert windowed.nonzero().squeeze(1).tolist() == [1, 2, 3, 5, 6]
    # the budget cuts a window: 2 then 1 (nearest neighbour on the left first)
    assert select_with_windows(scores, candidates, 2, 1, segments).nonzero().squeeze(1).tolist() == [1, 2]
    # never more than the candidates, never a non-candidate
    everything = select_with_windows(scores, candidates, 100, 2, segments)
    assert torch.equal(everything, candidates)


def test_grammar_parses_and_rejects():
    policy = parse_policy("prophet:0.3")
    assert isinstance(policy, ProphetPolicy) and policy.ratio == 0.3 and policy.radius == 1
    assert parse_policy("prophet:0.15:nowindow").radius == 0 and parse_policy("prophet").ratio == 0.15
    assert parse_policy_spec("prophet:0.2:nowindow").option
    for bad in ("prophet:auto", "prophet:1.5", "prophet:-0.1", "prophet:0.2:gradual", "prophet:0.2:nowindow:x"):
        with pytest.raises(PolicySpecError):
            parse_policy_spec(bad)
        with pytest.raises(InvalidPromptError):
            parse_policy(bad)


def test_ratio_one_equals_full_prefill_also_teacher_forced(tiny_engine):
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    full, _ = tiny_engine.prefill_logits(prompt, policy="full")
    answer = [int(full.argmax()), 11, 42, 7]
    full_tf, _ = tiny_engine.teacher_forced_logits(prompt, answer, policy="full")
    tiny_engine.warm(PASSAGES)
    one, stats = tiny_engine.prefill_logits(prompt, policy="prophet:1.0")
    assert stats.chunk_hits == 3
    assert (full - one).abs().max().item() <= 1e-4
    one_tf, _ = tiny_engine.teacher_forced_logits(prompt, answer, policy="prophet:1.0")
    assert torch.equal(one_tf.argmax(-1), full_tf.argmax(-1))
    assert (one_tf - full_tf).abs().max().item() <= 1e-4
    reuse, _ = tiny_engine.prefill_logits(prompt, policy="reuse")
    assert (reuse - full).abs().max().item() > 1e-3  # so the first check could fail


@pytest.mark.parametrize("spec", ["prophet:0.2", "prophet:0.2:nowindow"])
def test_budget_and_token_layers(tiny_engine, spec):
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    tiny_engine.warm(PASSAGES)
    _, stats = tiny_engine.prefill_logits(prompt, policy=spec)
    spans = [(s["positions"][0], s["positions"][1], s["mode"]) for s in stats.plan]
    fused = sum(e - s for s, e, mode in spans if mode == "fuse")
    fresh = sum(e - s for s, e, mode in spans if mode == "fresh")
    layers = tiny_engine.runner.num_layers
    budget = math.ceil(0.2 * fused - 1e-9)
    assert fused and stats.tokens_recomputed == budget
    # the main pass computes the fresh tokens and the budget on every layer; the probe computes
    # the fresh tokens (question, template) once more on every layer, and nothing else
    assert stats.token_layers_computed == (fresh + budget) * layers + fresh * layers
    assert stats.token_layers_computed <= (fresh + math.ceil(0.2 * fused)) * layers * 2


def test_probe_reads_the_questions_attention_in_a_reuse_pass(tiny_engine):
    """The probe's scores are the question's per-head-normalized attention over the fused tokens
    in a plain `reuse` prefill, averaged over layers, and the policy picks the top of them."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    tiny_engine.warm(PASSAGES)
    plan = plan_of(tiny_engine, prompt, "reuse")
    runner = tiny_engine.runner
    fused = span_masks(plan)[0]
    readers = reader_mask(plan)
    seen: list[torch.Tensor] = []

    def observe(layer, q, active, keys):
        r = readers[active.cpu()]
        seen.append(attention_scores(q[r], keys, active[r], torch.arange(keys.shape[0]), fused))

    fused_prefill(runner, plan, ReusePolicy(), observer=observe)
    reference = torch.stack(seen).mean(dim=0)
    scores, work = probe_scores(runner, plan)
    assert torch.allclose(scores, reference, atol=1e-5)
    uncached = torch.ones(plan.num_tokens, dtype=torch.bool)
    for span in plan.spans:
        if span.cached is not None and span.mode != "fresh":
            uncached[span.start : span.end] = False
    assert work == int(uncached.sum()) * runner.num_layers
    assert scores[~fused].abs().max().item() == 0.0 and abs(scores.sum().item() - 1.0) < 1e-4

    selection = ProphetPolicy(0.1, radius=0).select(PrefillView(runner, plan))
    picked = selection.initial & fused
    assert selection.fixed and selection.decided["selected"] == int(picked.sum())
    budget = math.ceil(0.1 * int(fused.sum()) - 1e-9)
    assert int(picked.sum()) == budget and not bool((picked & ~fused).any())
    # the picks are exactly the most-attended fused tokens
    top = torch.topk(reference.masked_fill(~fused, -1.0), budget).indices
    assert set(picked.nonzero().squeeze(1).tolist()) == set(top.tolist())


def test_selection_picks_the_tokens_the_question_is_made_to_attend_to(tiny_engine):
    """A constructed case: the cached keys of three tokens in the middle chunk are replaced, on
    every layer, by the question's mean query turned back by their RoPE angle, so the question
    attends to them sharply (the tiny random model's own attention is nearly flat). prophet picks
    exactly those three, and with windows their neighbours."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    tiny_engine.warm(PASSAGES)
    plan = plan_of(tiny_engine, prompt, "reuse")
    runner = tiny_engine.runner
    readers = reader_mask(plan)
    queries: list[torch.Tensor] = []

    def observe(layer, q, active, keys):
        mean = q[readers[active.cpu()]].float().mean(dim=0)  # [H, D]
        queries.append(mean.view(keys.shape[1], -1, mean.shape[-1]).mean(dim=1))  # [Hkv, D]

    fused_prefill(runner, plan, ReusePolicy(), observer=observe)
    middle = [s for s in plan.spans if s.mode == "fuse"][1]
    local = [3, 10, len(middle) - 4]
    targets = {middle.start + i for i in local}
    for layer, q in enumerate(queries):
        for i in local:
            position = torch.tensor([-(middle.start + i)])
            cos, sin = runner.rope_tables(position).at(layer)
            aligned = 8.0 * q / q.norm(dim=-1, keepdim=True) * math.sqrt(q.shape[-1])
            middle.cached.keys[layer, i] = apply_rope(aligned[None], cos, sin)[0].to(middle.cached.keys.dtype)
    fused = span_masks(plan)[0]
    picked = ProphetPolicy(3 / int(fused.sum()), radius=0).select(PrefillView(runner, plan)).initial & fused
    assert set(picked.nonzero().squeeze(1).tolist()) == targets
    windowed = ProphetPolicy(9 / int(fused.sum()), radius=1).select(PrefillView(runner, plan)).initial & fused
    assert set(windowed.nonzero().squeeze(1).tolist()) == {t + d for t in targets for d in (-1, 0, 1)}


def test_a_spec_is_frozen_and_each_selection_is_the_requests_own(tiny_engine):
    """Nothing a selection decides is written on the spec: it cannot be, and selections over two
    plans with one spec are independent (the first is the same when made again after the second)."""
    tiny_engine.warm(PASSAGES)
    runner = tiny_engine.runner
    plan = plan_of(tiny_engine, ChunkedPrompt(chunks=PASSAGES, question=QUESTION), "reuse")
    shorter = plan_of(tiny_engine, ChunkedPrompt(chunks=PASSAGES[:2], question=QUESTION), "reuse")
    spec = ProphetPolicy(0.2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.ratio = 0.5  # type: ignore[misc]
    first = spec.select(PrefillView(runner, plan))
    other = spec.select(PrefillView(runner, shorter))
    again = spec.select(PrefillView(runner, plan))
    assert first.initial.shape[0] == plan.num_tokens != other.initial.shape[0]
    assert torch.equal(first.initial, again.initial) and first.decided == again.decided
    assert spec == ProphetPolicy(0.2)


@pytest.mark.parametrize("policy", ["prophet:0.25", "prophet:0.25:nowindow", "prophet"])
def test_api_accepts_the_grammar(tiny_engine, policy):
    from fastapi.testclient import TestClient

    from engine_sidecar.server import ServerSettings, create_app

    body = {"prompt": {"chunks": PASSAGES[:2], "question": QUESTION}, "sampling": {"max_tokens": 1}}
    with TestClient(create_app(tiny_engine, ServerSettings(max_tokens=4))) as client:
        assert client.post("/v1/generate", json={**body, "policy": policy}).status_code == 200
        for bad in ("prophet:auto", "prophet:0.2:gradual", "prophet:2"):
            error = client.post("/v1/generate", json={**body, "policy": bad})
            assert error.status_code == 422 and error.json()["error"]["param"] == "policy"
            assert "prophet[:ratio[:nowindow][:probeL]]" in error.json()["error"]["message"]


def test_the_probe_is_invisible_to_the_benchs_per_layer_capture(tiny_engine):
    """bench fidelity reads the prefill's per-layer hidden states and TTFT stamps by wrapping
    `runner.mlp` on the instance: the probe must not add rows to it."""
    from engine_sidecar.calibrate.reference import capture_last_hidden

    tiny_engine.warm(PASSAGES)
    plan = plan_of(tiny_engine, ChunkedPrompt(chunks=PASSAGES, question=QUESTION), "reuse")
    with capture_last_hidden(tiny_engine.runner) as rows:
        fused_prefill(tiny_engine.runner, plan, ProphetPolicy(0.2))
    assert len(rows) == tiny_engine.runner.num_layers


def test_the_probe_reads_the_prefills_buffer_with_the_same_scores(tiny_engine):
    """Given the prefill's KV buffer (cached rows in place, keys rotated), the probe computes the
    very scores it computes from the plan's entries into a buffer of its own."""
    from engine_sidecar.execution.question_probe import ReusedKV, probe

    tiny_engine.warm(PASSAGES)
    plan = plan_of(tiny_engine, ChunkedPrompt(chunks=PASSAGES, question=QUESTION), "reuse")
    runner = tiny_engine.runner
    c = runner.config
    n = plan.num_tokens
    keys_pre = torch.zeros(runner.num_layers, n, c.num_kv_heads, c.head_dim, dtype=runner.dtype)
    values = torch.zeros_like(keys_pre)
    for span in plan.spans:
        if span.cached is not None and span.mode != "fresh":
            keys_pre[:, span.start : span.end] = span.cached.keys
            values[:, span.start : span.end] = span.cached.values
    cos, sin = runner.rope_tables(torch.arange(n)).at(0)
    lent = ReusedKV(apply_rope(keys_pre, cos, sin), values)
    own = probe(runner, plan)
    shared = probe(runner, plan, reused=lent)
    assert torch.allclose(shared.scores, own.scores, atol=1e-6) and shared.token_layers == own.token_layers
    with pytest.raises(ValueError, match="reused KV holds"):
        probe(runner, plan, reused=ReusedKV(lent.keys[:, :-1], lent.values[:, :-1]))


def test_probe_layers_stop_the_probe_and_count_only_its_layers(tiny_engine):
    tiny_engine.warm(PASSAGES)
    plan = plan_of(tiny_engine, ChunkedPrompt(chunks=PASSAGES, question=QUESTION), "reuse")
    runner = tiny_engine.runner
    full_scores, full_work = probe_scores(runner, plan)
    one_scores, one_work = probe_scores(runner, plan, layers=1)
    assert one_work * runner.num_layers == full_work
    fused = span_masks(plan)[0]
    assert abs(one_scores.sum().item() - 1.0) < 1e-4 and one_scores[~fused].abs().max().item() == 0.0
    assert not torch.allclose(one_scores, full_scores)  # layer 1 alone is not the average of all
    # through the grammar, served: the request's computed share counts the probe's one layer
    policy = parse_policy("prophet:0.2:nowindow:probe1")
    assert isinstance(policy, ProphetPolicy) and policy.layers == 1 and policy.radius == 0
    _, stats = tiny_engine.prefill_logits(ChunkedPrompt(chunks=PASSAGES, question=QUESTION),
                                          policy="prophet:0.2:probe1:nowindow")
    assert stats.chunk_hits == 3


def test_the_probe_reads_nothing_back_per_layer(tiny_engine, monkeypatch):
    """Each value read back from a tensor is a sync on a GPU: the probe's reads must not grow with
    its depth (the masks are made once, the scores summed on the device)."""
    tiny_engine.warm(PASSAGES)
    plan = plan_of(tiny_engine, ChunkedPrompt(chunks=PASSAGES, question=QUESTION), "reuse")
    probe_scores(tiny_engine.runner, plan, layers=1)  # first-call work (caches filled) off the count
    reads = []
    caller = threading.get_ident()
    for name in ("__bool__", "__int__", "__float__", "item", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if threading.get_ident() == caller:  # not the disk tier's writer, which runs meanwhile
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = []
    for layers in (1, 2, 3):
        reads.clear()
        probe_scores(tiny_engine.runner, plan, layers=layers)
        counts.append(len(reads))
    assert counts[0] == counts[1] == counts[2], counts


@pytest.mark.parametrize("spec,layers,option", [
    ("prophet:0.2:probe8", 8, False), ("prophet:0.2:nowindow:probe3", 3, True),
    ("prophet:0.15:probe2:nowindow", 2, True), ("mix:0.15:split:probe4", 4, True), ("mix:0.1:probe12", 12, False),
])
def test_probe_tag_grammar(spec, layers, option):
    parsed = parse_policy_spec(spec)
    assert parsed.probe_layers == layers and parsed.option is option


@pytest.mark.parametrize("spec", ["prophet:0.2:probe0", "prophet:0.2:probe", "prophet:0.2:probeX",
                                  "prophet:0.2:probe2:probe3", "prophet:0.2:nowindow:nowindow",
                                  "cacheblend:0.2:probe4", "gate:0.3:probe4"])
def test_bad_probe_tags_are_clear_errors(spec):
    with pytest.raises(PolicySpecError, match="bad argument"):
        parse_policy_spec(spec)
    with pytest.raises(InvalidPromptError):
        parse_policy(spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_probe_in_half_precision_scores_as_in_fp32(dtype):
    """In bf16/fp16 the probe scores in fp32 (the scores pick the tokens) and multiplies the
    attention output in that dtype: scores as fp32 computes them from the same rounded inputs,
    output within the dtype's rounding, the top picks unmoved."""
    gen = torch.Generator().manual_seed(5)
    n, heads, kv_heads, dim = 300, 9, 3, 64
    k, v = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen)
    query_pos = torch.arange(n - 12, n)
    q = torch.randn(12, heads, dim, generator=gen)
    k[40:50] += q[0, :kv_heads] * 0.4  # a few keys the readers clearly prefer
    readers = torch.ones(12, dtype=torch.bool)
    fused = torch.arange(n) < n - 12
    exact, exact_out = probe_attention(q, k, v, query_pos, torch.arange(n), readers, fused)
    scores, out = probe_attention(q.to(dtype), k.to(dtype), v.to(dtype), query_pos, torch.arange(n), readers, fused)
    assert out.dtype == dtype and scores.dtype == torch.float32
    rounded, _ = probe_attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), query_pos,
                                 torch.arange(n), readers, fused)
    assert torch.allclose(scores, rounded, atol=1e-7)
    assert torch.allclose(scores, exact, atol=2e-4, rtol=0.05)
    assert (out.float() - exact_out).abs().max().item() < 0.03
    assert set(torch.topk(scores, 10).indices.tolist()) == set(torch.topk(exact, 10).indices.tolist())


def test_a_policy_object_the_caller_passes_is_a_spec_it_keeps_unchanged(tiny_engine):
    """A Policy the caller passes is a frozen spec: the caller's object holds no request's
    selection afterwards, and two requests with it give what two requests with
    the spec string give."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    tiny_engine.warm(PASSAGES)
    spec = parse_policy("prophet:0.3")
    first = tiny_engine.generate(prompt, {"max_tokens": 3, "temperature": 0}, policy=spec)
    second = tiny_engine.generate(prompt, {"max_tokens": 3, "temperature": 0}, policy=spec)
    assert spec == parse_policy("prophet:0.3")
    by_name = tiny_engine.generate(prompt, {"max_tokens": 3, "temperature": 0}, policy="prophet:0.3")
    assert first.token_ids == second.token_ids == by_name.token_ids
    assert first.stats.tokens_recomputed == by_name.stats.tokens_recomputed > 0
    # what the request's selection decided is in its stats instead
    decided = first.stats.policy_decisions
    assert decided["selected"] == first.stats.tokens_recomputed and decided["probe_token_layers"] > 0
    assert decided["selected"] == by_name.stats.policy_decisions["selected"]


def test_an_auto_ratio_is_the_requests_not_the_specs(tiny_engine):
    """An `:auto` ratio is chosen per request from measured costs: it lands in the request's stats,
    and the spec object keeps the ratio it was parsed with."""
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    tiny_engine.warm(PASSAGES)
    spec = parse_policy("cacheblend:auto")
    parsed_ratio = spec.ratio
    result = tiny_engine.generate(prompt, {"max_tokens": 1, "temperature": 0}, policy=spec)
    assert spec.ratio == parsed_ratio
    chosen = result.stats.policy_decisions["ratio"]
    assert 0.0 <= chosen <= 1.0 and any(note.startswith(f"auto ratio {chosen:.3f}") for note in result.stats.notes)
