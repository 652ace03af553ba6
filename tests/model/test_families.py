"""Every supported family against transformers, and fusion's guards per family: full prefill equal
to transformers (fp32) and its greedy tokens (bf16), ratio 1.0 equal to full prefill, batched decode
equal to a full forward, a stored chunk's keys rotated to a new position equal to keys computed
there, one layer implementation behind every path, and refused families named in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_sidecar.errors import UnsupportedModelError
from engine_sidecar.execution import kernel_warmup
from engine_sidecar.execution.batched_decode import decode_batch, decode_step
from engine_sidecar.execution.fused_prefill import fused_prefill
from engine_sidecar.execution.plan import FusionPlan, PlanSpan
from engine_sidecar.execution.policies import CacheBlendPolicy, FullPolicy, ReusePolicy
from engine_sidecar.execution.question_probe import probe
from engine_sidecar.model.families import load_config
from engine_sidecar.model.families.phi3 import rotary_layout
from engine_sidecar.model.runner import ModelRunner
from tests.conftest import FAMILY_CONFIGS, assert_batched_decode_matches_forward, make_family_model

FAMILIES = list(FAMILY_CONFIGS)
PROMPT = 40  # tokens: past every window of the tiny models (8)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp(request.param), request.param)


def _ids(n: int = PROMPT, seed: int = 7) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _full(runner: ModelRunner, ids: list[int], extra: int = 1):
    plan = FusionPlan([PlanSpan("question", 0, tuple(ids), "fresh")], "full")
    return fused_prefill(runner, plan, FullPolicy(), capacity=len(ids) + extra)


def test_fp32_prefill_matches_transformers(family_dir):
    runner = ModelRunner.load(family_dir, device="cpu", dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(str(family_dir), dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert expected.abs().max() > 1.0  # logits far enough from zero to tell implementations apart
    assert (runner.forward(ids) - expected).abs().max().item() <= 1e-4
    # the executor's prefill (what every request runs) gives the same last-token logits
    assert (_full(runner, ids.tolist()).logits - expected[-1]).abs().max().item() <= 1e-4


def test_bf16_greedy_tokens_match_transformers(family_dir):
    """16 greedy steps of transformers in bf16, teacher-forced through our bf16 prefill and decode:
    the same token wherever transformers' own choice is clear of bf16's rounding (top-2 margin
    above 0.1 on logits of ~2; ties in bf16 are a coin toss for any two implementations), and our
    logits no further from fp32's than transformers' bf16 ones are."""
    runner = ModelRunner.load(family_dir, device="cpu", dtype="bfloat16")
    reference = AutoModelForCausalLM.from_pretrained(str(family_dir), dtype=torch.bfloat16).eval()
    exact = AutoModelForCausalLM.from_pretrained(str(family_dir), dtype=torch.float32).eval()
    ids = _ids(24, seed=11)
    with torch.no_grad():
        answer = reference.generate(ids[None], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0]
        theirs = reference(answer[None]).logits[0, len(ids) - 1 : -1].float()
        fp32 = exact(answer[None]).logits[0, len(ids) - 1 : -1]
    result = _full(runner, ids.tolist(), extra=16)
    ours = [result.logits]
    for token in answer[len(ids) : -1].tolist():
        ours.append(decode_step(runner, result.kv, token))
    mine = torch.stack(ours).float()
    top2 = theirs.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert int(clear.sum()) >= 8  # most steps decide something
    assert torch.equal(mine.argmax(-1)[clear], answer[len(ids) :][clear])
    assert (mine - fp32).abs().max() <= 2 * (theirs - fp32).abs().max() + 1e-2


def test_ratio_one_equals_full_prefill_and_reuse_differs(family_dir):
    """Chunks stored from one prefill, placed in reverse order at new positions: CacheBlend at
    ratio 1.0 recomputes them all (through every window and RoPE table) and equals full prefill of
    the same tokens; plain reuse does not."""
    runner = ModelRunner.load(family_dir, device="cpu", dtype="float32")
    ids = kernel_warmup.made_up_ids(64, runner.config.vocab_size, 3)
    plan = kernel_warmup.fused_plan(ids, kernel_warmup.full_kv(runner, ids))
    full = _full(runner, list(plan.token_ids))
    one = fused_prefill(runner, plan, CacheBlendPolicy(1.0), capacity=plan.num_tokens + 1)
    assert (one.logits - full.logits).abs().max().item() <= 1e-4
    n = plan.num_tokens
    assert (one.kv.keys[:, :n] - full.kv.keys[:, :n]).abs().max().item() <= 1e-4
    # reuse keeps the keys the chunks got in their first context (the logits may not show it where
    # every layer's window ends inside the question)
    reused = fused_prefill(runner, plan, ReusePolicy(), capacity=n + 1)
    assert (reused.kv.keys[:, :n] - full.kv.keys[:, :n]).abs().max().item() > 1e-3


def test_batched_decode_equals_full_forward_of_each_sequence(family_dir):
    assert_batched_decode_matches_forward(ModelRunner.load(family_dir, device="cpu", dtype="float32"), 1e-4, 3)


def test_stored_keys_rotated_equal_keys_computed_at_their_positions(family_dir):
    """Every layer: the buffer's pre-RoPE keys rotated by that layer's RoPE equal transformers' own
    cached keys (after its q/k norm and RoPE); a chunk's layer-0 keys stored at position 0 and
    rotated to offset d equal the keys transformers computes for it at d."""
    runner = ModelRunner.load(family_dir, device="cpu", dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(str(family_dir), dtype=torch.float32).eval()
    c = runner.config
    layout = rotary_layout(c.head_dim, c.rotary_dim)  # the identity where all of a head rotates
    ids = _ids()
    kv = _full(runner, ids.tolist()).kv
    with torch.no_grad():
        cache = reference(ids[None], use_cache=True).past_key_values
    positions = torch.arange(len(ids))
    for layer in range(c.num_layers):
        # [T, Hkv, D] in our layout; a sliding layer's cache keeps only its window's last rows
        theirs = cache.layers[layer].keys[0].transpose(0, 1)[..., layout]
        rotated = runner.rope(kv.keys_pre[layer, : len(ids)], positions, layer)[-theirs.shape[0] :]
        assert (rotated - theirs).abs().max().item() <= 1e-4, layer
    chunk, offset = ids[:13], 27
    stored = _full(runner, chunk.tolist()).kv.keys_pre[0, :13]
    placed = runner.rope(stored, torch.arange(offset, offset + 13), 0)
    with torch.no_grad():
        shifted = reference(torch.cat([_ids(offset, seed=5), chunk])[None], use_cache=True).past_key_values
    theirs = shifted.layers[0].keys[0].transpose(0, 1)[..., layout]
    rows = min(13, theirs.shape[0])  # a sliding layer 0 keeps its window's rows only
    assert (placed[-rows:] - theirs[-rows:]).abs().max().item() <= 1e-4


def test_sliding_layers_of_a_fused_prompt_see_only_their_window(tmp_path):
    """Under reuse, a sliding layer's queries never read a cached chunk's keys outside the window:
    zeroing those keys on the sliding layers changes nothing, on a global layer it does."""
    runner = ModelRunner.load(make_family_model(tmp_path, "gemma3_text"), device="cpu", dtype="float32")
    ids = kernel_warmup.made_up_ids(64, runner.config.vocab_size, 3)
    plan = kernel_warmup.fused_plan(ids, kernel_warmup.full_kv(runner, ids))
    base = fused_prefill(runner, plan, ReusePolicy(), capacity=plan.num_tokens + 1).logits
    first = plan.spans[0]
    assert first.cached is not None and first.end < plan.num_tokens - 8  # out of the question's window
    sliding = [i for i, w in enumerate(runner.layer_windows) if w is not None]
    for layers, changes in ((sliding, False), ([1], True)):
        keys = first.cached.keys.clone()
        keys[layers] = 0.0
        spans = [PlanSpan(s.kind, s.start, s.token_ids, s.mode,
                          type(s.cached)(keys, s.cached.values, s.cached.token_ids) if s is first else s.cached)
                 for s in plan.spans]
        logits = fused_prefill(runner, FusionPlan(spans, "t"), ReusePolicy(), capacity=plan.num_tokens + 1).logits
        assert ((logits - base).abs().max().item() > 1e-4) == changes


def test_one_layer_implementation_serves_prefill_decode_graphs_and_probe(tmp_path):
    """Replacing a family's layer object changes what all four paths compute: the executor's
    prefill, batched decode, the prefill graphs' fixed-address layers and the question probe."""
    from engine_sidecar.execution.prefill_graphs import PrefillGraphs

    runner = ModelRunner.load(make_family_model(tmp_path, "qwen3"), device="cpu", dtype="float32")
    calls: list[str] = []
    path = "setup"
    original = runner.layers[1]

    class Observed(type(original)):  # type: ignore[misc]
        def __init__(self) -> None:
            self.__dict__.update(original.__dict__)

        def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
            calls.append(path)
            return super().mlp(hidden)

    runner.layers[1] = Observed()
    ids = kernel_warmup.made_up_ids(48, runner.config.vocab_size, 1)
    plan = kernel_warmup.fused_plan(ids, kernel_warmup.full_kv(runner, ids))
    for name, run in (
        ("prefill", lambda: fused_prefill(runner, plan, ReusePolicy(), capacity=plan.num_tokens + 2)),
        ("decode", lambda: decode_batch(runner, [_full(runner, list(ids)).kv], [5])),
        ("graphs", lambda: PrefillGraphs(runner, 256, capture=False)._layers(_torch_graph(runner))),
        ("probe", lambda: probe(runner, plan)),
    ):
        path, before = name, len(calls)
        run()
        assert calls[before:] and set(calls[before:]) == {name}, name


def _torch_graph(runner: ModelRunner):
    """A prefill graph of 8 rows whose table kernels (Triton: minutes in the CPU interpreter) are
    stood in for by torch: what is checked is which layer code the graph's layers call."""
    from types import SimpleNamespace

    from engine_sidecar.execution.prefill_graphs import SparseGraph
    from ragcache_kernels.triton_prefill_table import TABLE_SIZE

    c = runner.config
    view = SimpleNamespace(store=lambda layer, joint, inv: joint[:, : c.num_heads * c.head_dim].unflatten(
        -1, (c.num_heads, c.head_dim)), attend=lambda layer, q: q)
    return SparseGraph(8, 0, torch.zeros(TABLE_SIZE + 8, dtype=torch.int64), torch.zeros(TABLE_SIZE),
                       torch.randn(8, c.hidden_size), view)


@pytest.mark.parametrize(("model_type", "reason"), [
    ("qwen3_next", "recurrent state"), ("deepseek_v3", "latent-attention"), ("qwen2_5_vl", "vision-language"),
    ("gemma3", "vision-language"), ("gpt2", "supported: llama"),
])
def test_refused_families_say_why_in_one_line(tmp_path, model_type, reason):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(UnsupportedModelError) as caught:
        load_config(tmp_path)
    message = str(caught.value)
    assert model_type in message and reason in message and "\n" not in message


def test_longrope_model_serves_up_to_its_original_length(tmp_path):
    """Past original_max_position_embeddings LongRoPE switches to other frequencies for every key:
    the engine's context is capped there, so the switch never happens under stored keys."""
    config = load_config(make_family_model(tmp_path, "phi3"))
    assert config.max_position_embeddings == 512 and config.rotary_dim == 8
