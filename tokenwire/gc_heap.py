"""Keeps Python's full garbage collections from walking each service's start-up heap.

Every service builds a large heap at start that lives as long as the process: the gateway's and
the detok worker's tokenizer and token tables, the model worker's model, engine and llguidance's
token trie (the gateway held ~335,000 tracked objects after start). A collection of the oldest
generation walks every tracked object while holding the GIL. In the stack on the 2-core host
(SmolLM2, 32 streams) such collections took 150 ms in the gateway, just as a wave of 32 requests
came in, and 195 ms in the model worker, whose engine thread needs the GIL between torch ops:
the whole serving path stopped for that long.

gc.freeze() moves every object that exists into a permanent generation that collections skip
(after a collection, so no garbage is kept): later objects (requests, their sequences, caches
that fill as tokens come) are collected as before. vLLM freezes its start-up heap the same way.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

logger = logging.getLogger(__name__)


def pause_collections_until_frozen() -> None:
    """No collections while the service starts: the heap it builds (model, tokenizer, tables)
    lives as long as the process, so collecting it finds little, and each full collection of a
    growing heap took longer (the model worker's start: 11 of them, 8 to 290 ms, 1.8 s of its
    7.2 s of CPU). freeze_startup_heap turns them back on."""
    gc.disable()


def freeze_startup_heap(what: str) -> None:
    """Collects once, then keeps every object that exists now out of later collections (and
    collections run again, if pause_collections_until_frozen stopped them)."""
    started = time.perf_counter()
    gc.collect()
    if not gc.get_freeze_count():
        # At exit everything goes back to the collected heap, so that finalizers run and
        # extensions' leak checks (nanobind's, in triton) see their objects freed.
        atexit.register(gc.unfreeze)
    gc.freeze()
    gc.enable()
    logger.info("%s: %d objects kept out of garbage collection (%.0f ms)", what, gc.get_freeze_count(),
                (time.perf_counter() - started) * 1e3)
