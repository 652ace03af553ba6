"""The three-passage prompt the question-driven policy tests (prophet, gate, mix) share."""

from ragcache_integrations import ChunkedPrompt

PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, at 5,895 metres.",
    "The Danube passes Vienna, Budapest and Belgrade before it reaches the Black Sea.",
]
QUESTION = "Which river reaches the Atlantic?"
PROMPT = ChunkedPrompt(chunks=PASSAGES, question=QUESTION)


def plan_of(engine, prompt: ChunkedPrompt, policy):
    """The FusionPlan the engine would run for `prompt` under `policy` (nothing computed yet)."""
    prompt, _, pol = engine.prep.prepare(prompt, None, policy, "preserve", "")
    return engine.cache.plan(prompt, pol, "").plan
