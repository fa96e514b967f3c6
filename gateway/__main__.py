"""Entry point: `python -m gateway --port 8000 --model-workers HOST:PORT,... --detok-workers HOST:PORT,...`.

Builds the one Config from flags and TOKENWIRE_GATEWAY_* env, then serves create_app(config)
with uvicorn; the app's lifespan waits for the workers before accepting requests.
"""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.config import Config
from tokenwire.config_cli import parse_config
from tokenwire.gc_heap import pause_collections_until_frozen
from tokenwire.grpc_io import log_io_note
from tokenwire.sched_slice import use_serving_slice
from tokenwire.stack import exit_with_the_stack


def main() -> None:
    exit_with_the_stack()  # started by `python -m tokenwire.stack`: end with it
    config = parse_config(Config, env_prefix="TOKENWIRE_GATEWAY_")
    pause_collections_until_frozen()  # the app's lifespan freezes the heap once the workers answer
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_io_note()
    use_serving_slice(config, "gateway", whole_process=True)  # uvicorn and gRPC start theirs later: they inherit it
    # On SIGTERM uvicorn stops accepting, lets open requests (streams included) finish for up to
    # drain_grace_s, then runs the lifespan's shutdown.
    uvicorn.run(create_app(config, freeze_heap=True), host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=config.drain_grace_s,
                # h11, even where httptools is installed (uvicorn's "auto" would take it): httptools drops
                # the body of a POST that offers an upgrade (Java's HttpClient and curl --http2 send
                # "Upgrade: h2c"; uvicorn #2722, httptools #124) and sets no limit on a header's size. It
                # was 0.37 ms faster to the first token (README, "TTFT the gateway and the detok worker add").
                http="h11",
                access_log=False,  # gateway.access logs each request with latency and token counts
                ssl_certfile=config.tls_cert_file or None, ssl_keyfile=config.tls_key_file or None)


if __name__ == "__main__":
    main()
