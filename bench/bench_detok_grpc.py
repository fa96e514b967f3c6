"""Detok throughput through gRPC: a real detok worker process, one client process, loopback.

Sits beside the detok worker, not in it: starts `python -m detok_worker` on a free port and
streams the frames a model worker's decode steps would cause (256 interleaved sequences, k
tokens each per frame, 2 stop strings each) over one Detokenize stream, writing and reading
concurrently; checks every text against tokenizer.decode and reports tokens/s end to end
(wall clock) and per CPU-second of the worker process, for the message form (one SequenceTokenIds
and TextDelta per sequence) and the column form (TokenColumns / TextColumns) in turn.

    .venv/bin/python bench/bench_detok_grpc.py --sequences 256 --tokens 128 --tokens-per-frame 1,4,16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

# Run as a script (`python bench/bench_detok_grpc.py`), sys.path[0] is bench/; the packages
# sit one level up and need not be pip-installed.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# Run as a script, bench/__init__ does not run first: tokenwire's choice of gRPC socket layer has to
# come before grpc is imported (tokenwire/grpc_io.py).
import tokenwire  # noqa: E402, F401, I001

import grpc  # noqa: E402

from bench.metrics import process_cpu_seconds  # noqa: E402
from bench.bench_detok import STOPS, add_reply_text, add_workload_args, corpus_ids, sequences_ids  # noqa: E402
from model_worker.model_files import resolve_model_dir  # noqa: E402
from tokenwire.grpc_server import CHANNEL_OPTIONS  # noqa: E402
from tokenwire.packing import pack_int32  # noqa: E402
from tokenwire.stack import ServiceProcess, free_port, spawn, wait_grpc_serving  # noqa: E402
from tokenwire.tokenizer_files import tokenizer_identity  # noqa: E402
from tokenwire.v1 import common_pb2, detok_worker_pb2_grpc  # noqa: E402
from tokenwire.v1 import detok_worker_pb2 as pb  # noqa: E402


def build_frames(identity: common_pb2.TokenizerIdentity, seqs: list[list[int]], run: int,
                 tokens_per_frame: int, columns: bool = False
                 ) -> tuple[pb.DetokenizeFrame, list[pb.DetokenizeFrame], list[str]]:
    names = [f"run{run}-seq{i}" for i in range(len(seqs))]
    # Handle i + 1 is names[i]; each run's sequences finish before the next run opens them again.
    opens = pb.DetokenizeFrame(opens=[
        pb.OpenSequence(sequence_id=name, tokenizer=identity, skip_special_tokens=True, stop=STOPS,
                        handle=i + 1 if columns else 0) for i, name in enumerate(names)])
    num_tokens = len(seqs[0])
    handles = pack_int32(range(1, len(seqs) + 1))
    frames = []
    for start in range(0, num_tokens, tokens_per_frame):
        end = min(start + tokens_per_frame, num_tokens)
        if columns:
            frames.append(pb.DetokenizeFrame(columns=pb.TokenColumns(
                handles=handles, num_tokens=pack_int32([end - start] * len(seqs)),
                token_ids=pack_int32([i for ids in seqs for i in ids[start:end]]),
                finished_handles=handles if end == num_tokens else b"")))
            continue
        frames.append(pb.DetokenizeFrame(tokens=[
            pb.SequenceTokenIds(sequence_id=name, token_ids=pack_int32(ids[start:end]), finished=end == num_tokens)
            for name, ids in zip(names, seqs, strict=True)]))
    return opens, frames, names


async def stream_frames(address: str, opens: pb.DetokenizeFrame, frames: list[pb.DetokenizeFrame],
                        names: list[str]) -> tuple[float, dict[str, str]]:
    """Seconds from the first token frame written to the last reply read, and the texts."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = detok_worker_pb2_grpc.DetokenizerStub(channel).Detokenize()
        await call.write(opens)
        await call.read()
        texts = dict.fromkeys(names, "")

        async def write_all() -> None:
            for frame in frames:
                await call.write(frame)
            await call.done_writing()

        began = time.perf_counter()
        writer = asyncio.create_task(write_all())
        for _ in frames:
            reply = await call.read()
            assert not any(delta.error for delta in reply.deltas), [d.error for d in reply.deltas]
            add_reply_text(texts, names, reply)
        seconds = time.perf_counter() - began
        await writer
        return seconds, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from tokenizers import Tokenizer

    model_dir = resolve_model_dir(args.model, args.cache_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    identity = tokenizer_identity(model_dir)
    seqs = sequences_ids(corpus_ids(tokenizer), args.sequences, args.tokens)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in seqs]

    port = free_port()
    address = f"127.0.0.1:{port}"
    worker: ServiceProcess = spawn("detok worker", "detok_worker", ["--host", "127.0.0.1", "--port", str(port),
                                                                     "--log-level", "warning"],
                                   env={"PYTHONPATH": str(REPO_ROOT)})
    try:
        wait_grpc_serving(worker, address, timeout_s=60)
        # Warm up: the worker loads the tokenizer and builds its byte tables on the first open.
        opens, frames, names = build_frames(identity, seqs[:2], -1, 4)
        asyncio.run(stream_frames(address, opens, frames, names))
        num_tokens = args.sequences * args.tokens
        print(f"SmolLM2 tokenizer, {args.sequences} sequences x {args.tokens} tokens, stops {STOPS!r}; "
              f"detok worker pid {worker.process.pid} on {address}; best of {args.repeats}")
        print(f"{'form':>8} {'tok/seq/frame':>13} {'frames':>7} {'wall s':>8} {'tokens/s (wall)':>16} "
              f"{'worker CPU s':>13} {'tokens/worker-CPU-s':>20} {'x message (wall)':>17}")
        run = 0
        for tokens_per_frame in (int(k) for k in args.tokens_per_frame.split(",")):
            # Repeats alternate the two forms, so both see the same load on a shared machine.
            best: dict[bool, tuple[float, float]] = {}
            for _ in range(args.repeats):
                for columns in (False, True):
                    opens, frames, names = build_frames(identity, seqs, run, tokens_per_frame, columns)
                    run += 1
                    cpu_before = process_cpu_seconds(worker.process.pid)
                    seconds, texts = asyncio.run(stream_frames(address, opens, frames, names))
                    cpu = process_cpu_seconds(worker.process.pid) - cpu_before
                    assert [texts[name] for name in names] == expected, "gRPC detok output differs from decode"
                    if columns not in best or seconds < best[columns][0]:
                        best[columns] = (seconds, cpu)
            for columns in (False, True):
                seconds, cpu = best[columns]
                print(f"{'columns' if columns else 'message':>8} {tokens_per_frame:>13} {len(frames):>7} "
                      f"{seconds:>8.3f} {num_tokens / seconds:>16,.0f} {cpu:>13.3f} "
                      f"{num_tokens / max(cpu, 1e-9):>20,.0f} {best[False][0] / seconds:>17.2f}")
    finally:
        worker.stop(timeout_s=10)


if __name__ == "__main__":
    main()
