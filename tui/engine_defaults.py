"""The engine defaults the app adds to the engine's own (`minivllm-chat` and its bench)."""

from __future__ import annotations

# Step token budget on a CPU: a step computes at most this many tokens, so a long paste
# in one pane is prefilled in chunks while the other panes keep streaming. On a 2-core
# CPU, 64 tokens of SmolLM2 keep a step near a fifth of a second; the paste's own time to
# its first token hardly changes (the same work in more steps), where the engine's default
# budget made steps of seconds that froze every other pane.
CPU_STEP_TOKENS = 64


def runs_on_cpu(device: str) -> bool:
    """Whether an engine for `device` ("auto", "cuda" or "cpu") runs on the CPU here."""
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    from minivllm.cli import torch_gpu_build

    if not torch_gpu_build():  # known without importing torch (seconds before the window)
        return True
    import torch

    return not torch.cuda.is_available()
