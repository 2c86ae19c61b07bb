"""Layout snapshot of minivllm-chat: three resumed panes and frozen engine stats.

Update after an intended change with `pytest tests/test_tui_snapshot.py --snapshot-update`
and look at the SVG under tests/__snapshots__/.
"""

from __future__ import annotations

import json

from minivllm.tui.app import create_app
from minivllm.tui.conversation import Settings

from minivllm.outputs import EngineStats
from minivllm.server.standin import ScriptedEngine

FROZEN = EngineStats(
    block_size=256, num_blocks=2047, num_used_blocks=612, num_running=3, num_waiting=1,
    num_preemptions=0, prefix_cache_hit_rate=0.375, prompt_tokens_per_s=512.3,
    generation_tokens_per_s=87.1, num_prompt_tokens=20480, num_generated_tokens=4096,
    num_steps=1234, last_step_time_s=0.0123, last_batch_size=4,
)

SESSION = [
    {"type": "pane", "pane": 1, "settings": Settings().to_dict()},
    {"type": "pane", "pane": 2, "settings": Settings(temperature=0.0, max_tokens=256,
                                                     system_prompt="Be terse.").to_dict()},
    {"type": "pane", "pane": 3, "settings": Settings(thinking=False).to_dict()},
    {"type": "user", "pane": 1, "text": "Write a Python function that reverses a string."},
    {"type": "end", "pane": 1, "status": "done", "text":
        "Here is one way:\n\n```python\ndef reverse(s: str) -> str:\n    return s[::-1]\n```\n\n"
        "Slicing with a step of `-1` walks the string **backwards**."},
    {"type": "user", "pane": 2, "text": "What is paged attention?"},
    {"type": "end", "pane": 2, "status": "done", "text":
        "<think>\nThe user wants a short definition.\n</think>\n\n"
        "Paged attention stores the KV cache in fixed-size *blocks*, so sequences share "
        "memory without fragmentation:\n\n- blocks are allocated on demand\n"
        "- a block table maps positions to blocks"},
    {"type": "user", "pane": 3, "text": "Count to one hundred."},
    {"type": "end", "pane": 3, "status": "stopped", "text": "1, 2, 3, 4, 5, 6, 7, 8"},
]


def test_layout_snapshot(snap_compare, tmp_path):
    folder = tmp_path / "data" / "sessions"
    folder.mkdir(parents=True)
    (folder / "snapshot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SESSION))
    # float32 pinned: `auto` is bf16 on a CPU with AVX-512 BF16, and the header shows it.
    engine = ScriptedEngine({"dtype": "float32"})
    engine.stats = lambda: FROZEN
    app = create_app(engine, data_root=tmp_path / "data",
                     resume=True, stats_interval=3600)

    async def settle(pilot):
        for pane in app.panes:
            pane.input.cursor_blink = False
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=(160, 48), run_before=settle)
