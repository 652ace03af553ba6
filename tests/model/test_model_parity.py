"""The model runner must equal transformers: every fusion result is only as good as this."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_sidecar.model.runner import ModelRunner
from tests.conftest import make_tiny_model

FP32_TOL = 1e-3
# Mistral with a window shorter than the prompt, so the window is exercised
OVERRIDES = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 16}}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_tiny_prefill_logits_match_transformers(tmp_path, model_type):
    model_dir = make_tiny_model(tmp_path, model_type, **OVERRIDES[model_type])
    runner = ModelRunner.load(model_dir, device="cpu", dtype="float32")
    assert model_type != "mistral" or runner.config.sliding_window == 16
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = runner.forward(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_tiny_bf16_prefill_is_as_close_to_fp32_as_transformers_bf16(tmp_path, model_type):
    """bf16 rounds differently in any two implementations; what must hold is that ours strays
    from the fp32 result no further than transformers' own bf16 forward does."""
    model_dir = make_tiny_model(tmp_path, model_type, **OVERRIDES[model_type])
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()(ids[None]).logits[0]
        hf_bf16 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()(ids[None])
    hf_error = (hf_bf16.logits[0].float() - exact).abs().max().item()
    ours = ModelRunner.load(model_dir, device="cpu", dtype="bfloat16").forward(ids)
    our_error = (ours - exact).abs().max().item()
    assert our_error <= 2 * hf_error + 1e-3, (our_error, hf_error)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    model_dir = make_tiny_model(tmp_path, "llama", rope_scaling=scaling, rope_theta=500000.0)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    runner = ModelRunner.load(model_dir, device="cpu", dtype="float32")
    assert runner.config.rope.rope_type == "llama3"
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (runner.forward(ids) - expected).abs().max().item() <= FP32_TOL


@pytest.fixture(scope="module")
def smol_pair(smol_dir):
    reference = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    return reference, ModelRunner.load(smol_dir, device="cpu", dtype="float32")


def _chat_ids(smol_dir, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return torch.tensor(tok(rendered, add_special_tokens=False)["input_ids"])


def test_smollm2_prefill_logits_match_transformers(smol_dir, smol_pair):
    reference, runner = smol_pair
    ids = _chat_ids(smol_dir, "What is the capital of France? Answer in one word.")
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (runner.forward(ids) - expected).abs().max().item() <= FP32_TOL


def test_smollm2_greedy_decode_matches_transformers(smol_dir, smol_pair):
    from engine_sidecar.execution.batched_decode import decode_step
    from engine_sidecar.execution.fused_prefill import fused_prefill
    from engine_sidecar.execution.plan import FusionPlan, PlanSpan
    from engine_sidecar.execution.policies import FullPolicy

    reference, runner = smol_pair
    ids = _chat_ids(smol_dir, "Name three colours of the rainbow.")
    with torch.no_grad():
        expected = reference.generate(ids[None], max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(ids):]
    plan = FusionPlan([PlanSpan("question", 0, tuple(ids.tolist()), "fresh")], "full")
    result = fused_prefill(runner, plan, FullPolicy(), capacity=len(ids) + 20)
    token = int(result.logits.argmax())
    got = [token]
    for _ in range(19):
        token = int(decode_step(runner, result.kv, token).argmax())
        got.append(token)
    assert got == expected.tolist()


def test_rotating_pre_rope_keys_equals_prefill_at_offset(smol_pair):
    """Layer 0: a chunk's keys stored before RoPE, rotated to offset d, equal the keys of
    prefilling the chunk at positions d..d+n-1 (layer-0 keys do not depend on context)."""
    _, runner = smol_pair
    chunk = torch.randint(0, 49152, (23,), generator=torch.Generator().manual_seed(5))
    offset = 311
    pre_rope = runner.qkv(0, runner.embed(chunk)).k
    rotated = runner.rope(pre_rope, torch.arange(offset, offset + 23))
    # reference: transformers' own layer-0 keys for the chunk placed at that offset
    padded = torch.cat([torch.zeros(offset, dtype=torch.long), chunk])
    with torch.no_grad():
        out = smol_pair[0](padded[None], use_cache=True)
    ref_keys = out.past_key_values.layers[0].keys[0].transpose(0, 1)[offset:]
    assert (rotated - ref_keys).abs().max().item() <= 1e-4


@pytest.mark.parametrize("override", [{"attention_bias": True}, {"mlp_bias": True}], ids=["o_proj-bias", "mlp-bias"])
def test_tensors_the_runner_would_ignore_refuse_the_model(tmp_path, override):
    from engine_sidecar.errors import UnsupportedModelError

    model_dir = make_tiny_model(tmp_path, "llama", **override)
    with pytest.raises(UnsupportedModelError, match="not supported") as info:
        ModelRunner.load(model_dir, device="cpu", dtype="float32")
    assert "bias" in str(info.value) and len(str(info.value).splitlines()) == 1


def test_bf16_on_a_cpu_without_native_bf16_warns(tmp_path, monkeypatch, caplog):
    import engine_sidecar.model.runner as runner_mod

    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    amx = tmp_path / "amx"
    amx.write_text("flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert runner_mod.cpu_bf16_native(avx2) is False
    assert runner_mod.cpu_bf16_native(amx) is True
    assert runner_mod.cpu_bf16_native(tmp_path / "missing") is None
    cpu = torch.device("cpu")
    for native, warned in ((False, True), (True, False), (None, False)):
        monkeypatch.setattr(runner_mod, "cpu_bf16_native", lambda native=native: native)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ragcache.model"):
            assert runner_mod.resolve_dtype("bfloat16", cpu) == torch.bfloat16
            assert runner_mod.resolve_dtype("float32", cpu) == torch.float32
        assert any("emulated" in r.message for r in caplog.records) is warned
