"""One policy registry (`ragcache_integrations.policy_registry`) feeds the engine's parser, the CLI
help, the HTTP API's validation and the adapters: each of them must list and accept exactly the
registry's policies."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine_sidecar.cli.main import build_parser, main
from engine_sidecar.errors import InvalidPromptError
from engine_sidecar.execution.policies import Policy, parse_policy
from engine_sidecar.server import ServerSettings, create_app
from ragcache_integrations.policy_registry import (
    BY_NAME,
    DEFAULT_POLICY,
    NAMES,
    POLICIES,
    PolicySpecError,
    forms,
    parse_policy_spec,
)

ROOT = Path(__file__).resolve().parents[2]
BAD_SPECS = ["magic", "", "Full", "full:1", "reuse:x", "cacheblend:7", "cacheblend:-0.1", "cacheblend:nan",
             "cacheblend:0.2:fast", "cacheblend:0.2:gradual:x", "focus:auto", "focus:0.2:gradual", "epic:1.5",
             "epic:-1", "epic:16:x", "cachetune:1.5", "cachetune:0.2:gradual", "cachecraft:-1", "cachecraft:inf",
             "cachecraft:1:stop"]


def _listed_forms(text: str) -> list[str]:
    """The policy forms a message or help text names, in order (`name` or `name[...]`)."""
    names = "|".join(sorted(NAMES, key=len, reverse=True))
    return re.findall(rf"(?<![\w-])(?:{names})(?:\[[\w:|\[\]]+|(?![\w-]))", text)


@pytest.mark.parametrize("entry", POLICIES, ids=NAMES)
def test_every_registry_entry_parses_into_its_policy(entry):
    for spec in entry.examples:
        policy = parse_policy(spec)
        assert isinstance(policy, Policy) and policy.name == entry.name, spec
        assert parse_policy_spec(spec).name == entry.name


def test_parsed_arguments_reach_the_policy_objects():
    blend = parse_policy("cacheblend:0.3:gradual")
    assert (blend.ratio, blend.gradual, blend.auto) == (0.3, True, False)
    auto = parse_policy("cacheblend:auto")
    assert auto.auto and auto.ratio == 0.15 and not auto.gradual
    assert parse_policy("cacheblend:0.15:gradual").gradual
    assert parse_policy("epic:4").k == 4 and parse_policy("epic").k == 16
    assert parse_policy("focus:0.25").ratio == 0.25
    tune = parse_policy("cachetune:auto")
    assert tune.auto and tune.ratio == 0.15
    craft = parse_policy("cachecraft:0.5:nostop")
    assert craft.alpha == 0.5 and not craft.early_stop and parse_policy("cachecraft").early_stop


def test_registry_defaults_are_the_policy_classes_defaults():
    """A bare name and a Policy built without arguments must be the same policy."""
    from engine_sidecar.execution.policies import (
        CacheBlendPolicy,
        CacheCraftPolicy,
        CacheTunePolicy,
        EpicPolicy,
        FocusPolicy,
        GatePolicy,
        MixPolicy,
        ProphetPolicy,
    )

    classes = {"cacheblend": (CacheBlendPolicy, "ratio"), "focus": (FocusPolicy, "ratio"), "epic": (EpicPolicy, "k"),
               "cachetune": (CacheTunePolicy, "ratio"), "cachecraft": (CacheCraftPolicy, "alpha"),
               "prophet": (ProphetPolicy, "ratio"), "gate": (GatePolicy, "ratio"),
               "mix": (MixPolicy, "ratio")}
    assert set(classes) == {e.name for e in POLICIES if e.arg is not None}
    for name, (cls, param) in classes.items():
        assert inspect.signature(cls).parameters[param].default == BY_NAME[name].default, name


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_bad_specs_are_rejected_the_same_way_by_registry_and_engine(spec):
    with pytest.raises(PolicySpecError) as registry:
        parse_policy_spec(spec)
    with pytest.raises(InvalidPromptError) as engine:
        parse_policy(spec)
    assert str(engine.value) == str(registry.value)


def test_unknown_policy_message_lists_exactly_the_registry_forms():
    with pytest.raises(PolicySpecError) as info:
        parse_policy_spec("magic")
    assert _listed_forms(str(info.value)) == forms()


def test_cli_help_lists_exactly_the_registry_policies(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    commands["bench"].add_pending_commands()  # the lab's subcommands, otherwise added when `bench` is parsed
    helps = {"generate": commands["generate"], "demo": commands["demo"],
             "bench prefetch": commands["bench"]._subparsers._group_actions[0].choices["prefetch"]}
    for where, sub in helps.items():
        (action,) = [a for a in sub._actions if "--policy" in a.option_strings]
        grammar, _, described = str(action.help).partition(f"(default {DEFAULT_POLICY}).")
        assert _listed_forms(grammar) == forms(), where
        # and one description per policy, in registry order
        assert re.findall(r"(?:^|; )(\w+) = ", described.strip()) == list(NAMES), where
    with pytest.raises(SystemExit):
        main(["generate", "q", "--policy", "cacheblend:2"])
    err = capsys.readouterr().err
    assert "argument --policy: bad argument in policy 'cacheblend:2'" in err and "[0, 1]" in err


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    from engine_sidecar import Engine

    engine = Engine.from_pretrained(tiny_llama_dir, device="cpu", dtype="float32",
                                    cache_dir=tmp_path_factory.mktemp("policy-kv"))
    with engine, TestClient(create_app(engine, ServerSettings(max_tokens=4))) as c:
        yield c


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/generate", {"prompt": {"chunks": ["x"], "question": "Why?"}, "sampling": {"max_tokens": 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi?"}], "chunks": ["x"], "max_tokens": 1}),
])
def test_api_rejects_an_unknown_policy_listing_exactly_the_registry_forms(client, path, body):
    response = client.post(path, json={**body, "policy": "magic"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "policy" and error["code"] == "invalid_policy"
    assert _listed_forms(error["message"]) == forms()
    bad_arg = client.post(path, json={**body, "policy": "epic:many"}).json()["error"]
    assert "epic[:k]" in bad_arg["message"] and bad_arg["param"] == "policy"
    for entry in POLICIES:  # and every registry form gets past validation
        assert client.post(path, json={**body, "policy": entry.examples[-1]}).status_code == 200, entry.name


def test_openapi_describes_the_policy_field_from_the_registry(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    for model in ("GenerateRequest", "ChatCompletionRequest"):
        description = schema[model]["properties"]["policy"]["description"]
        grammar = description.partition("(default")[0]
        assert _listed_forms(grammar) == forms(), model


def test_adapters_reject_a_bad_policy_at_construction():
    from ragcache_integrations.langchain import ChunkCachedChatModel, ChunkCachedRunnable
    from ragcache_integrations.llama_index import ChunkCachedLLM

    url = "http://127.0.0.1:9"  # never contacted: construction must fail first
    for make in (lambda p: ChunkCachedLLM(base_url=url, policy=p),
                 lambda p: ChunkCachedChatModel(base_url=url, policy=p),
                 lambda p: ChunkCachedRunnable(base_url=url, policy=p)):
        with pytest.raises(ValueError, match=r"unknown policy 'magic': use full, prefix"):
            make("magic")
        make("epic:8")  # a valid spec constructs


def test_docs_list_exactly_the_registry_policies():
    config = (ROOT / "docs" / "configuration.md").read_text()
    section = config.split("### Policies", 1)[1].split("\n#", 1)[0]
    assert re.findall(r"^- `([^`]+)` — ", section, flags=re.M) == forms()
    api = (ROOT / "docs" / "api.md").read_text()
    policy_item = api.split("- `policy` — ", 1)[1].split("\n- ", 1)[0]
    assert _listed_forms(policy_item.split("; default")[0].replace("`", " ")) == forms()


def test_registry_and_adapters_import_without_torch():
    code = ("import sys\nimport ragcache_integrations.policy_registry, ragcache_integrations.api_models\n"
            "import ragcache_integrations.langchain, ragcache_integrations.langchain_retriever\n"
            "import ragcache_integrations.llama_index\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert not [m for m in sys.modules if m.startswith('engine_sidecar')]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
