"""A model worker with no model, for measuring the serving path alone (bench/serving_path.py).

    python -m bench.stand_in_model_worker --port 50051 --step-ms 25

It serves the ModelWorker contract the gateway uses (GetModelInfo with the default model's
tokenizer, GetLoad, Generate) and "decodes" on a clock: every --step-ms, each running request gets
one token, all of them in one TokenFrame, as the real engine's steps send them (with
--stream-interval N, or a request's own AddRequest.stream_interval, a request's tokens go out every
N steps, N at a time, as the model worker sends them). The tokens are the tokenizer's ordinary
(not added or special) ids in a pseudo-random walk seeded by the request id, so the detok worker
and the gateway do their real work on them; a request ends with FINISH_REASON_LENGTH at max_tokens
(0: the context length). No model runs, so the CPU the gateway and the detok worker take per token
can be read without torch competing for the cores (on this 2-core host the engine keeps both busy
and the serving path's wake-ups queue behind it).

What the load generator's requests use is honoured; a request asking for more (n > 1, best_of,
beam search, logprobs, prompt logprobs, stop token ids, structured output) is refused with
INVALID_ARGUMENT rather than answered wrongly. Closing the client side aborts nothing: the stream
ends once its requests have, as the model worker's does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tokenizers import Tokenizer

from model_worker.config import DEFAULT_CACHE_DIR
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir
from tokenwire import grpc_server
from tokenwire.packing import pack_int32
from tokenwire.stack import Stack, start_stack
from tokenwire.tokenizer_files import TOKENIZER_JSON, tokenizer_identity
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

logger = logging.getLogger("stand_in_model_worker")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelWorker"].full_name
MAX_MODEL_LEN = 1 << 16
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class _Running:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    stream_interval: int
    num_output_tokens: int = 0
    walk: int = 0  # state of its pseudo-random walk over the plain ids
    unsent: list[int] = field(default_factory=list)  # ids made since its last frame


def plain_ids_of(tokenizer: Tokenizer) -> list[int]:
    """The vocabulary's ids that are not added tokens (specials sit first in SmolLM2's vocabulary,
    last in Llama-3's and Qwen2's)."""
    added = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in added]


def next_plain_id(walk: int, plain_ids: list[int]) -> tuple[int, int]:
    """(the next id, the walk's next state): a linear congruential walk over plain_ids."""
    walk = (walk * 1103515245 + 12345) & 0x7FFFFFFF
    return plain_ids[walk % len(plain_ids)], walk


def unsupported(add: pb.AddRequest) -> str | None:
    """What of `add` the stand-in cannot honour, or None."""
    asks = {"n > 1": add.n > 1, "best_of": add.best_of > 1, "beam search": add.use_beam_search,
            "logprobs": add.logprobs or add.top_logprobs > 0, "prompt logprobs": add.HasField("prompt_logprobs"),
            "stop token ids": bool(add.stop_token_ids), "structured output": add.HasField("structured_output")}
    names = [name for name, asked in asks.items() if asked]
    return f"the stand-in model worker does not do {', '.join(names)}" if names else None


class StandInModelWorker(model_worker_pb2_grpc.ModelWorkerServicer):
    def __init__(self, info: pb.ModelInfo, plain_ids: list[int], step_s: float, stream_interval: int = 1) -> None:
        self.info = info
        self.plain_ids = plain_ids
        self.step_s = step_s
        self.stream_interval = max(stream_interval, 1)
        self.num_running = 0

    async def GetModelInfo(self, request, context):
        return self.info

    async def GetLoad(self, request, context):
        return pb.WorkerLoad(num_running=self.num_running, max_waiting=1 << 20)

    def _admit(self, add: pb.AddRequest) -> _Running | pb.SequenceTokens:
        refusal = unsupported(add)
        if refusal is not None:
            return pb.SequenceTokens(request_id=add.request_id, finish_reason=pb.FINISH_REASON_ERROR,
                                     error=pb.RequestError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                           message=refusal))
        num_prompt_tokens = len(add.prompt_token_ids)
        max_tokens = add.max_tokens or MAX_MODEL_LEN - num_prompt_tokens
        return _Running(add.request_id, num_prompt_tokens, max(max_tokens, 1),
                        add.stream_interval or self.stream_interval, walk=zlib.crc32(add.request_id.encode()))

    async def Generate(self, request_iterator, context):
        running: dict[str, _Running] = {}
        ended: list[pb.SequenceTokens] = []

        async def read() -> None:
            async for frame in request_iterator:
                for add in frame.adds:
                    admitted = self._admit(add)
                    if isinstance(admitted, _Running):
                        running[add.request_id] = admitted
                    else:
                        ended.append(admitted)
                for abort in frame.aborts:
                    if running.pop(abort.request_id, None) is not None:
                        ended.append(pb.SequenceTokens(request_id=abort.request_id,
                                                       finish_reason=pb.FINISH_REASON_ABORT))

        reader = asyncio.create_task(read())
        next_step = time.monotonic()
        try:
            # Until the client has closed its side and every request of the stream has ended.
            while not (reader.done() and not running and not ended):
                next_step += self.step_s
                await asyncio.sleep(max(next_step - time.monotonic(), 0.0))
                sequences, ended[:] = ended[:], []
                for request in list(running.values()):
                    token_id, request.walk = next_plain_id(request.walk, self.plain_ids)
                    request.unsent.append(token_id)
                    request.num_output_tokens += 1
                    done = request.num_output_tokens >= request.max_tokens
                    if not done and request.num_output_tokens % request.stream_interval:
                        continue
                    sequences.append(pb.SequenceTokens(
                        request_id=request.request_id, token_ids=pack_int32(request.unsent),
                        num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
                        finish_reason=pb.FINISH_REASON_LENGTH if done else pb.FINISH_REASON_UNSPECIFIED))
                    request.unsent = []
                    if done:
                        del running[request.request_id]
                self.num_running = len(running)
                if sequences:
                    yield pb.TokenFrame(sequences=sequences)
            reader.result()  # a reader that failed fails the call
        finally:
            reader.cancel()


def model_info(model_dir: Path, tokenizer: Tokenizer) -> pb.ModelInfo:
    return pb.ModelInfo(model_id="stand-in", vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                        eos_token_ids=[], max_model_len=MAX_MODEL_LEN, tokenizer=tokenizer_identity(model_dir))


def tokenizer_of(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / TOKENIZER_JSON))


def stand_in(model_dir: Path, step_s: float, stream_interval: int = 1) -> StandInModelWorker:
    tokenizer = tokenizer_of(model_dir)
    return StandInModelWorker(model_info(model_dir, tokenizer), plain_ids_of(tokenizer), step_s, stream_interval)


@contextlib.contextmanager
def stand_in_stack(stand_in_args: Sequence[str], **start_stack_kwargs: Any) -> Iterator[Stack]:
    """tokenwire.stack.start_stack with the stand-in as the model worker. It runs as
    `python -m bench.stand_in_model_worker`, and `bench` is no installed package: the repository
    root goes on the services' PYTHONPATH, so that it starts from any directory."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), *paths]))
    with start_stack(stand_in_args, model_worker_module="bench.stand_in_model_worker", **start_stack_kwargs) as stack:
        yield stack


async def serve(address: str, servicer: StandInModelWorker) -> None:
    server = grpc_server.new_server()
    model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(servicer, server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE_NAME])
    await grpc_server.mark_serving(health, [SERVICE_NAME])
    await grpc_server.serve_until_signal(server, address, 1.0, None, health)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--step-ms", type=float, default=25.0, help="time between two decode steps")
    parser.add_argument("--stream-interval", type=int, default=1, help="steps between a request's frames")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer to serve")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    args = parser.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_dir = resolve_model_dir(args.model, Path(args.cache_dir))
    asyncio.run(serve(f"{args.host}:{args.port}", stand_in(model_dir, args.step_ms / 1e3, args.stream_interval)))


if __name__ == "__main__":
    main()
