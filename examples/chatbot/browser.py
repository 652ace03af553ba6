"""Drive the chatbot page in headless Chromium (Debian's `chromium`, through Playwright, which
never downloads a browser here): ask questions, read back what the page shows, take a screenshot.

    python -m examples.chatbot.browser http://127.0.0.1:8800/ --screenshot docs/img/chatbot.png \\
        "What kind of play is Hannibal and Scipio?" "Who wrote it?" "Who developed the television series Hannibal?"
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Without the background-networking flags Chromium keeps dialling Google hosts, which a closed
# network refuses; --no-sandbox because CI runs as root.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@dataclass
class TurnView:
    """One turn as the page shows it."""

    question: str
    answer: str
    deltas: int  # how many streamed pieces the answer arrived in
    numbers: str
    tokens_reused: int
    error: str
    sources: list[str]  # chunk ids shown under "Sources" after this turn
    cut: bool = False  # the answer reached the length limit and the page marks it


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def drive(url: str, questions: list[str], screenshot: Path | None = None, timeout_s: float = 300) -> list[TurnView]:
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        raise RuntimeError("no Chromium found: install Debian's `chromium` package")
    views: list[TurnView] = []
    with tempfile.TemporaryDirectory(prefix="ragcache-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=executable, args=CHROMIUM_ARGS,
                                                        headless=True, viewport={"width": 1280, "height": 820})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.set_default_timeout(timeout_s * 1000)
            page.goto(url)
            for n, question in enumerate(questions, 1):
                page.fill("#question", question)
                page.click("#ask")
                page.wait_for_selector(f".turn:nth-child({n})[data-done=true]")
                turn = page.locator(".turn").nth(n - 1)
                nums = turn.locator(".nums")
                views.append(TurnView(
                    question=question,
                    answer=turn.locator(".a").inner_text(),
                    deltas=int(turn.locator(".a").get_attribute("data-deltas") or 0),
                    numbers=nums.inner_text(),
                    tokens_reused=int(nums.get_attribute("data-reused") or -1),
                    error=" ".join(turn.locator(".error").all_inner_texts()),
                    sources=[s.get_attribute("data-chunk-id") or "" for s in page.locator(".source").all()],
                    cut=turn.locator(".a").get_attribute("data-cut") == "true",
                ))
            if screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            context.close()
    return views


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.chatbot.browser", description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the chatbot page, e.g. http://127.0.0.1:8800/")
    p.add_argument("questions", nargs="+", help="questions asked in order, in one conversation")
    p.add_argument("--screenshot", type=Path, default=None, help="save a full-page PNG here at the end")
    args = p.parse_args(argv)
    try:
        views = drive(args.url, args.questions, args.screenshot)
    except RuntimeError as exc:
        raise SystemExit(f"browser: error: {exc}") from None
    for v in views:
        print(f"Q: {v.question}\nA: {v.answer}\n   {v.numbers}\n   sources: {', '.join(v.sources)}")
        if v.error:
            print(f"   error: {v.error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
