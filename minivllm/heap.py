"""Keep the garbage collector's full passes out of the hot loops.

Python's collector runs when allocations pile up, in the middle of whatever runs then. Its
full pass scans every object the process holds: torch's and the model's in an engine's
process, the widgets and lines in the app's. That is 40-200 ms, during which an engine
steps no sequence, a server writes no chunk and the app paints no frame; under load a
full pass came every few seconds. `settle` collects at a quiet moment (an engine just
built, a server just ready, an app with nothing streaming) and moves what survives to
the permanent generation (`gc.freeze`) that later passes skip: a pass mid-stream then
scans only what was made since.
"""

from __future__ import annotations

import gc


def settle(everything: bool = False) -> None:
    """Collect now and freeze the survivors. `everything`: collect what an earlier call
    froze too (only a full pass frees a closed pane's widgets, which refer to each other)."""
    if everything:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
