"""`tempT` in the policy grammar as the docs state it: every fusing policy takes it after its
argument, or right after the name with the argument left at its default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ragcache_integrations import ChunkedPrompt
from ragcache_integrations.policy_registry import POLICIES, PolicySpecError, parse_policy_spec, policy_help
from tests.policy_prompt import PASSAGES, QUESTION

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _placed(entry, tag: str) -> str:
    """`tag` where the grammar puts it: after the argument, spelled out where the policy takes one."""
    return f"{entry.name}:{tag}" if entry.arg is None else f"{entry.name}:{entry.default:g}:{tag}"


@pytest.mark.parametrize("entry", POLICIES, ids=lambda e: e.name)
def test_every_fusing_policy_takes_temp_after_its_argument(entry):
    if not entry.tempers:
        with pytest.raises(PolicySpecError):
            parse_policy_spec(_placed(entry, "temp1.5"))
        return
    assert parse_policy_spec(_placed(entry, "temp1.5")).temperature == 1.5


@pytest.mark.parametrize("spec,spelled", [("cachecraft:temp20", "cachecraft:1:temp20"),
                                          ("cacheblend:min32:temp1.1", "cacheblend:0.15:min32:temp1.1"),
                                          ("epic:temp2", "epic:16:temp2"), ("prophet:probe8", "prophet:0.15:probe8"),
                                          ("cacheblend:gradual", "cacheblend:0.15:gradual")])
def test_tags_right_after_the_name_leave_the_argument_at_its_default(spec, spelled):
    assert parse_policy_spec(spec) == parse_policy_spec(spelled)


@pytest.mark.parametrize("spec", ["cachecraft:temp20:1", "epic:temp2:temp3", "cacheblend:min32:0.2", "full:temp2",
                                  "prefix:temp2"])
def test_an_argument_after_a_tag_or_a_tag_twice_is_refused(spec):
    with pytest.raises(PolicySpecError):
        parse_policy_spec(spec)


def test_the_help_and_the_docs_say_where_temp_goes_and_their_examples_parse():
    assert "takes :tempT after its argument" in policy_help()
    section = DOC.read_text(encoding="utf-8").split("### Policies", 1)[1].split("\n#", 1)[0]
    examples = set(re.findall(r"`([a-z]+:[\w.:]*temp[\w.]+)`", section))
    assert {"cachecraft:temp20", "cachecraft:1:temp20", "reuse:temp1.1"} <= examples
    for spec in examples:
        assert parse_policy_spec(spec).temperature is not None  # every documented tempT example is valid


def test_cachecraft_fuses_so_its_temperature_changes_the_logits(tiny_llama_dir, tmp_path, monkeypatch):
    from engine_sidecar import Engine

    monkeypatch.setenv("RAGCACHE_HOME", str(tmp_path))  # no calibrated T from the user's home
    prompt = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)
    with Engine.from_pretrained(tiny_llama_dir, dtype="float32", disk=False, prefix_tree=False) as engine:
        engine.warm(PASSAGES)
        plain = engine.prefill_logits(prompt, policy="cachecraft:0:temp1")[0]
        tempered = engine.prefill_logits(prompt, policy="cachecraft:0:temp20")[0]
    assert (plain - tempered).abs().max().item() > 1e-3
