"""The README's picture of the playground: one answer streamed in the system's Chromium, then a screenshot.

    oai-gemma serve &                     # on a quiet machine: the timing panel shows its speed
    python benchmarks/playground_screenshot.py http://127.0.0.1:8000/ docs/playground.png

Needs `apt-get install chromium` and the `playwright` package (the test extra).
"""

from __future__ import annotations

import argparse

from playwright.sync_api import expect, sync_playwright

ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--system", default="You are a helpful assistant.")
    parser.add_argument("--temperature", default="0.8")
    parser.add_argument("--seed", default="3")  # a seed whose answer on the embedded model shows a list
    parser.add_argument("--max-tokens", default="80")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 860})
        page.goto(args.url)
        expect(page.locator("#model")).not_to_have_text("…")
        page.fill("#system", args.system)
        page.fill("#temperature", args.temperature)
        page.fill("#seed", args.seed)
        page.fill("#max_tokens", args.max_tokens)
        page.fill("#prompt", args.prompt)
        page.press("#prompt", "Enter")
        expect(page.locator(".msg.assistant[data-done]")).to_have_count(1, timeout=600_000)
        page.screenshot(path=args.out)
        browser.close()


if __name__ == "__main__":
    main()
