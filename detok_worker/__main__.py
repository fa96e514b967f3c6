"""Entry point of the detok worker: `python -m detok_worker --host 127.0.0.1 --port 50052`.

Builds the Config from flags and TOKENWIRE_DETOK_* env, then serves the Detokenizer
service with health and reflection until SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from detok_worker.config import Config
from detok_worker.servicer import SERVICE_FULL_NAME, DetokenizerServicer
from detok_worker.token_bytes import TokenizerDecoding
from detok_worker.token_table import decoding_with_tables
from tokenwire.config_cli import parse_config
from tokenwire.gc_heap import freeze_startup_heap, pause_collections_until_frozen
from tokenwire.grpc_io import log_io_note
from tokenwire.grpc_server import (
    add_health_and_reflection,
    check_port,
    mark_serving,
    new_server,
    run_worker,
    serve_until_signal,
    wait_quiet,
)
from tokenwire.loop_watchdog import LoopWatchdog
from tokenwire.sched_slice import use_serving_slice
from tokenwire.stack import ENV_PREFIXES, exit_with_the_stack
from tokenwire.v1 import common_pb2, detok_worker_pb2_grpc

logger = logging.getLogger("detok_worker")


def decoding_then_freeze() -> Callable[[common_pb2.TokenizerIdentity], TokenizerDecoding]:
    """decoding_with_tables, and the first time a tokenizer loads (with its tables), the heap
    frozen out of later full collections (tokenwire/gc_heap.py): the gateway's warm-up
    RenderTokens pays it, before any stream opens."""
    frozen: set[tuple[str, str]] = set()

    def open_decoding(identity: common_pb2.TokenizerIdentity) -> TokenizerDecoding:
        decoding = decoding_with_tables(identity)
        key = (identity.path, identity.sha256)
        if key not in frozen:
            frozen.add(key)
            freeze_startup_heap(f"detok worker, tokenizer {identity.path}")
        return decoding

    return open_decoding


async def serve(config: Config) -> None:
    check_port(config.host, config.port)
    server = new_server()
    servicer = DetokenizerServicer(decoding_then_freeze())
    detok_worker_pb2_grpc.add_DetokenizerServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, [SERVICE_FULL_NAME])
    await mark_serving(health_servicer, [SERVICE_FULL_NAME])
    logger.info("detok worker serving %s on %s", SERVICE_FULL_NAME, config.address)

    with LoopWatchdog(config.loop_stall_exit_s):
        # Ends once no sequence has been open for DRAIN_QUIET_S.
        await serve_until_signal(server, config.address, config.drain_grace_s, config.tls, health_servicer,
                                 drained=lambda: wait_quiet(servicer.is_drained))


def main() -> None:
    exit_with_the_stack()  # started by `python -m tokenwire.stack`: end with it
    config = parse_config(Config, env_prefix=ENV_PREFIXES["detok_worker"])
    pause_collections_until_frozen()  # frozen once the first tokenizer is loaded (decoding_then_freeze)
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_io_note()
    use_serving_slice(config, "detok worker", whole_process=True)  # gRPC starts its threads later: they inherit it
    run_worker("detok_worker", serve(config))


if __name__ == "__main__":
    main()
