"""A model worker with no model, for measuring the serving path alone (bench/serving_path.py).

    python -m bench.stand_in_model_worker --port 50051 --step-ms 25

It serves the ModelWorker contract the gateway uses (GetModelInfo with the default model's
tokenizer, GetLoad, Generate) and "decodes" on a clock: every --step-ms, each running request gets
one token, all of them in one TokenFrame, as the real engine's steps send them (with
--stream-interval N, a request's tokens go out every N steps, N at a time, as the model worker's
flag of that name sends them). The tokens are
ordinary vocabulary ids from a fixed pseudo-random sequence, so the detok worker and the gateway do
their real work on them; a request ends with FINISH_REASON_LENGTH at max_tokens. No model runs, so
the CPU the gateway and the detok worker take per token can be read without torch competing for the
cores (on this 2-core host the engine keeps both busy and the serving path's wake-ups queue behind it).

Only what the load generator's requests use is honoured: n = 1, no logprobs, no stop token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from model_worker.config import DEFAULT_CACHE_DIR
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir
from tokenwire import grpc_server
from tokenwire.packing import pack_int32
from tokenwire.tokenizer_files import num_token_ids, tokenizer_identity
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

logger = logging.getLogger("stand_in_model_worker")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelWorker"].full_name

# Ids below this are the special tokens of SmolLM2's vocabulary (and of most BPE vocabularies'
# first few entries); the stand-in emits plain text tokens only.
FIRST_PLAIN_ID = 100


@dataclass
class _Running:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    next_id: int = 0  # state of its pseudo-random id sequence
    unsent: list[int] = field(default_factory=list)  # ids made since its last frame


def plain_token_id(state: int, vocab_size: int) -> tuple[int, int]:
    """(the next id, the next state): a linear congruential walk over the plain ids."""
    state = (state * 1103515245 + 12345) & 0x7FFFFFFF
    return FIRST_PLAIN_ID + state % (vocab_size - FIRST_PLAIN_ID), state


class StandInModelWorker(model_worker_pb2_grpc.ModelWorkerServicer):
    def __init__(self, info: pb.ModelInfo, step_s: float, stream_interval: int = 1) -> None:
        self.info = info
        self.step_s = step_s
        self.stream_interval = max(stream_interval, 1)
        self.num_running = 0

    async def GetModelInfo(self, request, context):
        return self.info

    async def GetLoad(self, request, context):
        return pb.WorkerLoad(num_running=self.num_running, max_waiting=1 << 20)

    async def Generate(self, request_iterator, context):
        running: dict[str, _Running] = {}
        ended: list[pb.SequenceTokens] = []

        async def read() -> None:
            async for frame in request_iterator:
                for add in frame.adds:
                    if add.n > 1 or add.use_beam_search or add.logprobs:
                        ended.append(pb.SequenceTokens(
                            request_id=add.request_id, finish_reason=pb.FINISH_REASON_ERROR,
                            error=pb.RequestError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                  message="the stand-in model worker serves n = 1 without logprobs")))
                        continue
                    running[add.request_id] = _Running(add.request_id, len(add.prompt_token_ids),
                                                       max(add.max_tokens, 1), next_id=hash(add.request_id) & 0xFFFF)
                for abort in frame.aborts:
                    if running.pop(abort.request_id, None) is not None:
                        ended.append(pb.SequenceTokens(request_id=abort.request_id,
                                                       finish_reason=pb.FINISH_REASON_ABORT))

        reader = asyncio.create_task(read())
        next_step = time.monotonic()
        try:
            while not reader.done():
                next_step += self.step_s
                await asyncio.sleep(max(next_step - time.monotonic(), 0.0))
                sequences, ended[:] = ended[:], []
                for request in list(running.values()):
                    token_id, request.next_id = plain_token_id(request.next_id, self.info.vocab_size)
                    request.unsent.append(token_id)
                    request.num_output_tokens += 1
                    done = request.num_output_tokens >= request.max_tokens
                    if not done and request.num_output_tokens % self.stream_interval:
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
            reader.result()
        finally:
            reader.cancel()


def model_info(model_dir: Path) -> pb.ModelInfo:
    return pb.ModelInfo(model_id="stand-in", vocab_size=num_token_ids(model_dir), eos_token_ids=[],
                        max_model_len=1 << 16, tokenizer=tokenizer_identity(model_dir))


async def serve(address: str, step_s: float, stream_interval: int, model_dir: Path) -> None:
    server = grpc_server.new_server()
    model_worker_pb2_grpc.add_ModelWorkerServicer_to_server(
        StandInModelWorker(model_info(model_dir), step_s, stream_interval), server)
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
    asyncio.run(serve(f"{args.host}:{args.port}", args.step_ms / 1e3, args.stream_interval, model_dir))


if __name__ == "__main__":
    main()
