"""The services keep their start-up heap out of full garbage collections (tokenwire/gc_heap.py)."""

from __future__ import annotations

import gc

import detok_worker.__main__ as detok_main
from tokenwire.gc_heap import freeze_startup_heap
from tokenwire.tokenizer_files import tokenizer_identity


def test_freeze_keeps_what_exists_out_of_collections_and_not_what_comes_later():
    existing = [object()]  # a list: tracked by the collector
    try:
        freeze_startup_heap("test")
        assert gc.get_freeze_count() > 0
        tracked = gc.get_objects()  # the collected generations only
        assert not any(obj is existing for obj in tracked)
        later = [object()]
        assert any(obj is later for obj in gc.get_objects())
    finally:
        gc.unfreeze()  # this test process's heap goes back to being collected


def test_the_detok_worker_freezes_once_per_tokenizer_it_loads(smollm2_dir, monkeypatch):
    frozen: list[str] = []
    monkeypatch.setattr(detok_main, "freeze_startup_heap", frozen.append)
    open_decoding = detok_main.decoding_then_freeze()
    identity = tokenizer_identity(smollm2_dir)
    first = open_decoding(identity)
    assert open_decoding(identity) is first
    assert len(frozen) == 1 and str(smollm2_dir) in frozen[0]
    assert first.token_bytes  # the tables were built before the freeze
