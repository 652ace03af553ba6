"""mix: CacheBlend's KV deviation and prophet's question attention combined by rank. Ranks and
both selection modes on hand-computed scores, the policy's pick equal to `select_mixed` of the
probe's scores and the check layer's deviation, its budget and token-layers, the ratio-1.0 guard
(== full prefill, also teacher-forced), and the grammar."""

from __future__ import annotations

import math

import pytest
import torch

from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.mix import percentile_ranks, rank_average, select_mixed
from engine_sidecar.execution.policies import LayerView, MixPolicy, PrefillView, parse_policy, span_masks
from engine_sidecar.execution.question_probe import probe_scores
from ragcache_integrations.policy_registry import PolicySpecError, parse_policy_spec
from tests.policy_prompt import PASSAGES, PROMPT


def test_percentile_ranks_by_hand():
    # candidates 1..4 with scores [5, 1, 3, 3]: ranks 3, 0, 1.5, 1.5 of 3 -> [1, 0, 0.5, 0.5]
    scores = torch.tensor([100.0, 5.0, 1.0, 3.0, 3.0])
    candidates = torch.tensor([False, True, True, True, True])
    assert torch.allclose(percentile_ranks(scores, candidates), torch.tensor([-1.0, 1.0, 0.0, 0.5, 0.5]))
    assert percentile_ranks(torch.tensor([7.0]), torch.tensor([True])).tolist() == [1.0]
    assert percentile_ranks(torch.tensor([7.0]), torch.tensor([False])).tolist() == [-1.0]


def test_rank_average_and_rank_selection_by_hand():
    # 5 candidates. question ranks (of 4): t0 4, t1 3, t2 0, t3 2, t4 1 -> [1, .75, 0, .5, .25]
    # deviation ranks:                    t0 0, t1 3, t2 4, t3 2, t4 1 -> [0, .75, 1, .5, .25]
    # averages [0.5, 0.75, 0.5, 0.5, 0.25]: t1 first, then t0 (question 0.9 breaks the tie), t3, t2
    question = torch.tensor([0.9, 0.5, 0.0, 0.3, 0.1])
    deviation = torch.tensor([0.0, 3.0, 9.0, 2.0, 1.0])
    candidates = torch.ones(5, dtype=torch.bool)
    assert torch.allclose(rank_average(question, deviation, candidates), torch.tensor([0.5, 0.75, 0.5, 0.5, 0.25]))
    assert select_mixed(question, deviation, candidates, 1).nonzero().squeeze(1).tolist() == [1]
    assert select_mixed(question, deviation, candidates, 2).nonzero().squeeze(1).tolist() == [0, 1]
    assert select_mixed(question, deviation, candidates, 3).nonzero().squeeze(1).tolist() == [0, 1, 3]
    # the top of either list alone (t0 by question, t2 by deviation) is not the top of the mix
    assert not bool(select_mixed(question, deviation, candidates, 1)[2])


def test_split_selection_by_hand_and_candidates_respected():
    question = torch.tensor([0.9, 0.5, 0.0, 0.3, 0.1, 5.0])
    deviation = torch.tensor([0.0, 3.0, 9.0, 2.0, 1.0, 50.0])
    candidates = torch.tensor([True, True, True, True, True, False])  # t5 is must-keep, never chosen
    # budget 3: question's half (2, the odd token to it): t0, t1; deviation's among the rest: t2
    assert select_mixed(question, deviation, candidates, 3, "split").nonzero().squeeze(1).tolist() == [0, 1, 2]
    # budget 4: question t0, t1; deviation (t1 taken) t2, t3
    assert select_mixed(question, deviation, candidates, 4, "split").nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    for mode in ("rank", "split"):
        assert torch.equal(select_mixed(question, deviation, candidates, 99, mode), candidates)
        assert not bool(select_mixed(question, deviation, candidates, 0, mode).any())
    with pytest.raises(ValueError):
        select_mixed(question, deviation, candidates, 2, "other")


def test_grammar_parses_and_rejects():
    policy = parse_policy("mix:0.3")
    assert isinstance(policy, MixPolicy) and policy.ratio == 0.3 and policy.mode == "rank"
    assert parse_policy("mix:0.15:split").mode == "split" and parse_policy("mix").ratio == 0.15
    with pytest.raises(InvalidPromptError):  # an empty field is refused: spell the default out
        parse_policy("mix::split")
    for bad in ("mix:auto", "mix:1.5", "mix:0.2:nowindow", "mix:0.2:split:x"):
        with pytest.raises(PolicySpecError):
            parse_policy_spec(bad)
        with pytest.raises(InvalidPromptError):
            parse_policy(bad)


def test_ratio_one_equals_full_prefill_also_teacher_forced(tiny_engine):
    full, _ = tiny_engine.prefill_logits(PROMPT, policy="full")
    answer = [int(full.argmax()), 11, 42, 7]
    full_tf, _ = tiny_engine.teacher_forced_logits(PROMPT, answer, policy="full")
    tiny_engine.warm(PASSAGES)
    one, stats = tiny_engine.prefill_logits(PROMPT, policy=MixPolicy(1.0))
    assert stats.chunk_hits == 3 and stats.policy_decisions["probe_token_layers"] == 0  # no probe at r = 1
    assert (full - one).abs().max().item() <= 1e-4
    one_tf, _ = tiny_engine.teacher_forced_logits(PROMPT, answer, policy="mix:1.0:split")
    assert torch.equal(one_tf.argmax(-1), full_tf.argmax(-1))
    assert (one_tf - full_tf).abs().max().item() <= 1e-4
    reuse, _ = tiny_engine.prefill_logits(PROMPT, policy="reuse")
    assert (reuse - full).abs().max().item() > 1e-3  # so the first check could fail


@pytest.mark.parametrize("mode", ["rank", "split"])
def test_the_pick_is_select_mixed_of_probe_and_deviation(tiny_engine, mode):
    """At the check layer the kept tokens are exactly `select_mixed` of the probe's scores and the
    value deviation the layer sees; the budget is CacheBlend's, and the probe is counted."""
    tiny_engine.warm(PASSAGES)
    tiny_engine.prefill_logits(PROMPT, policy="reuse")  # the template prefix cached too
    prompt, _, pol = tiny_engine.prep.prepare(PROMPT, None, "reuse", "preserve", "")
    plan = tiny_engine.cache.plan(prompt, pol, "").plan
    runner = tiny_engine.runner
    fused, fresh = span_masks(plan)
    selection = MixPolicy(0.2, mode).select(PrefillView(runner, plan))
    scores, expected_work = probe_scores(runner, plan)
    assert selection.token_layers == selection.decided["probe_token_layers"] == expected_work > 0
    assert selection.refine is not None and selection.refines_until(runner.num_layers) == 1
    active_mask = selection.initial
    active = active_mask.nonzero().squeeze(1)
    must_keep = fresh[active]
    gen = torch.Generator().manual_seed(0)
    new_v = torch.randn(active.shape[0], 2, 4, generator=gen)
    all_v = torch.randn(plan.num_tokens, 2, 4, generator=gen)
    view = LayerView(1, active, must_keep, torch.zeros_like(new_v), new_v, torch.zeros_like(all_v), all_v,
                     runner.num_layers)
    keep = selection.refine(view)
    assert keep is not None
    deviation = (new_v - all_v[active]).pow(2).sum(dim=(1, 2))
    budget = math.ceil(0.2 * int(fused.sum()))
    expected = must_keep | select_mixed(scores[active], deviation, ~must_keep, budget, mode)
    assert torch.equal(keep, expected) and int((keep & ~must_keep).sum()) == budget
    view.layer = 2
    assert selection.refine(view) is None  # only the check layer chooses


def test_token_layers_include_the_probe(tiny_engine):
    tiny_engine.warm(PASSAGES)
    tiny_engine.prefill_logits(PROMPT, policy="reuse")
    _, blend = tiny_engine.prefill_logits(PROMPT, policy="cacheblend:0.2")
    _, stats = tiny_engine.prefill_logits(PROMPT, policy=MixPolicy(0.2))
    probed = stats.policy_decisions["probe_token_layers"]
    assert stats.tokens_recomputed == blend.tokens_recomputed
    assert stats.token_layers_computed == blend.token_layers_computed + probed
    assert probed > 0


def test_ranks_and_rank_order_match_the_definition_on_random_ties():
    """The sort-based ranks equal the definition (strictly lower + half the equal others), and the
    rank pick equals a plain sort by (average desc, question desc, position)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        n = int(torch.randint(2, 40, (1,), generator=gen))
        a = torch.randint(0, 5, (n,), generator=gen).float()  # few values: many ties
        b = torch.randint(0, 5, (n,), generator=gen).float()
        cand = torch.rand(n, generator=gen) < 0.8
        m = int(cand.sum())
        for scores in (a, b):
            ranks = percentile_ranks(scores, cand)
            for i in range(n):
                if not cand[i]:
                    assert ranks[i] == -1.0
                    continue
                others = scores[cand]
                expected = (float((others < scores[i]).sum()) + (float((others == scores[i]).sum()) - 1) / 2)
                assert abs(float(ranks[i]) - (expected / (m - 1) if m > 1 else 1.0)) < 1e-6
        avg = rank_average(a, b, cand)
        order = sorted(cand.nonzero().squeeze(1).tolist(), key=lambda i: (-float(avg[i]), -float(a[i]), i))
        budget = max(1, m // 2)
        picked = select_mixed(a, b, cand, budget).nonzero().squeeze(1).tolist()
        assert picked == sorted(order[:budget])
