"""The detok worker's frames of one or a few streams: DetokenizeStream.apply per frame, with the
few-rows lane (HandleTable.few_rows_lane) on and off, warm and with the CPU caches flushed first.

A worker serving one or a few streams gets a frame every decode step and waits in between, while
other processes (the engine, the gateway) run: each frame then finds its caches cold, where numpy's
per-call overhead is several times what a warm loop shows. This runs both lanes in one process,
frame by frame in turn, so the ratio is side by side.

    python -m bench.bench_detok_small_frames --frames 400 --rows 1,4,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from detok_worker.stream import DetokenizeStream
from model_worker.config import DEFAULT_CACHE_DIR
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir
from tokenwire.packing import pack_int32
from tokenwire.tokenizer_files import tokenizer_identity
from tokenwire.v1 import detok_worker_pb2 as pb

FLUSH_BYTES = 32 << 20  # more than this host's L2 and L3 per core together


def frame_times(model_dir: Path, rows: int, num_frames: int, cold: bool) -> dict[str, list[float]]:
    """Seconds per frame of `rows` sequences, one id each, for the lane on and off (two streams fed
    the same frames in turn). Every 16 frames the sequences are closed and new ones opened in the
    next frame, as new requests would be."""
    identity = tokenizer_identity(model_dir)
    streams = {"lane": DetokenizeStream(), "numpy": DetokenizeStream()}
    streams["numpy"]._columns.few_rows_lane = False
    flush = np.zeros(FLUSH_BYTES, dtype=np.uint8)
    rng = np.random.default_rng(rows)
    ids = rng.integers(300, 40000, size=(num_frames, rows)).tolist()  # mostly whole-word ids of SmolLM2
    times: dict[str, list[float]] = {name: [] for name in streams}
    for number in range(num_frames):
        generation = number // 16
        names = [f"s{generation}-{row}" for row in range(rows)]
        frame = pb.DetokenizeFrame()
        if number % 16 == 0:
            frame.opens.extend(pb.OpenSequence(sequence_id=name, tokenizer=identity, skip_special_tokens=True,
                                               handle=row + 1) for row, name in enumerate(names))
        frame.columns.handles = pack_int32(range(1, rows + 1))
        frame.columns.num_tokens = pack_int32([1] * rows)
        frame.columns.token_ids = pack_int32(ids[number])
        for name, stream in streams.items():
            if cold:
                flush += 1
            began = time.perf_counter()
            stream.apply(frame).SerializeToString()
            times[name].append(time.perf_counter() - began)
            if number % 16 == 15:
                stream.apply(pb.DetokenizeFrame(closes=[pb.CloseSequence(sequence_id=n) for n in names]))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--rows", default="1,4,8", help="sequences per frame, comma-separated")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer decodes")
    args = parser.parse_args(argv)
    model_dir = resolve_model_dir(args.model, DEFAULT_CACHE_DIR)
    print("| rows | caches | lane, us per frame (p50) | numpy flow, us per frame (p50) | numpy / lane |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for cold in (False, True):
            times = frame_times(model_dir, rows, args.frames, cold)
            lane, numpy_flow = (statistics.median(times[name][16:]) * 1e6 for name in ("lane", "numpy"))
            print(f"| {rows} | {'flushed' if cold else 'warm'} | {lane:.1f} | {numpy_flow:.1f} | "
                  f"{numpy_flow / lane:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
