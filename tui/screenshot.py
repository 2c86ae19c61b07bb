"""Save a screenshot of three panes streaming on the real engine: an SVG and, next to
it, the same screen as text (`.txt`).

    python -m minivllm.tui.screenshot [--out docs/screenshot.svg] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from .conversation import Settings

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing clear commit messages, as a list.",
]


async def shoot(out: Path, model: str, device: str, min_tokens: int) -> None:
    from minivllm import LLMEngine

    from .app import create_app
    from .testing import wait_ready, wait_until

    config = {"model_name_or_path": model, "device": device}
    app = create_app(
        engine_factory=lambda on_progress: LLMEngine(config, on_progress=on_progress),
        model=model, conversations=3, save_sessions=False,
        settings=Settings(temperature=0.7, max_tokens=400),
    )
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_ready(pilot, 600)
        for pane, text in zip(app.panes, PROMPTS, strict=True):
            await app.send(pane, text)
        await wait_until(pilot, lambda: all(p.tokens >= min_tokens for p in app.panes)
                         or not any(p.busy for p in app.panes), 900)
        await pilot.pause()
        for pane in app.panes:
            pane.input.cursor_blink = False
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))
        # NOTE: Textual exports SVG only; the text is the compositor's lines (private API).
        lines = [strip.text.rstrip() for strip in app.screen._compositor.render_strips()]
        out.with_suffix(".txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        await pilot.press("ctrl+q")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.tui.screenshot")
    p.add_argument("--out", type=Path, default=Path("docs/screenshot.svg"))
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto")
    p.add_argument("--min-tokens", type=int, default=60)
    args = p.parse_args(argv)
    asyncio.run(shoot(args.out, args.model, args.device, args.min_tokens))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
