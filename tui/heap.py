"""Keep the garbage collector's full passes out of the app's frames.

Python's collector runs when allocations pile up, in the middle of whatever runs then. Its
full pass scans every object the process holds (the app's widgets and lines and, with the
engine in this process, torch's and the model's): 60-200 ms on 2 cores, a frozen picture in
every pane while replies stream. The app calls `settle` when nothing streams: it collects
then, and moves what survives to the permanent generation (`gc.freeze`) that later passes
skip, so a pass mid-stream scans only what was made since.
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
