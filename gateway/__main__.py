"""Entry point: `python -m gateway --port 8000 --model-workers HOST:PORT,... --detok-workers HOST:PORT,...`.

Builds the one Config from flags and TOKENWIRE_GATEWAY_* env, waits for the workers, then
serves create_app(config) with uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl

import uvicorn

from gateway.app import create_app
from gateway.config import Config
from gateway.pipeline import Pipeline
from tokenwire.config_cli import parse_config
from tokenwire.gc_heap import pause_collections_until_frozen
from tokenwire.grpc_io import log_io_note
from tokenwire.loop_watchdog import LoopWatchdog
from tokenwire.sched_slice import use_serving_slice
from tokenwire.stack import ENV_PREFIXES, exit_with_the_stack

logger = logging.getLogger("gateway")

# uvicorn's code for a failed start (its lifespan's), kept for a gateway whose workers never came
STARTUP_FAILURE = 3
# How long before --drain-grace-s runs out the requests still open are ended with a 503 (at most
# half the grace): uvicorn polls for closed connections every 0.1 s, so a second is ample for the
# 503s to go out and their connections to close.
DRAIN_FAIL_MARGIN_S = 1.0


async def connect_unless_stopped(config: Config, app) -> int | None:
    """Waits for the workers (up to --startup-timeout-s) before uvicorn starts, and puts the
    pipeline on app.state for the lifespan. SIGINT/SIGTERM meanwhile ends the wait at once
    (returns 128 + the signal's number): under uvicorn, which holds signals until its lifespan has
    started, the gateway went on waiting up to --startup-timeout-s (300 s) after a SIGTERM."""
    loop = asyncio.get_running_loop()
    connecting = asyncio.create_task(Pipeline.connect(config, app.state.metrics))
    signals: list[int] = []

    def stop(sig: int) -> None:
        signals.append(sig)
        connecting.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    logger.info("waiting for the workers (up to --startup-timeout-s %g)", config.startup_timeout_s)
    try:
        app.state.pipeline = await connecting
    except asyncio.CancelledError:
        if not signals:
            raise
        logger.info("%s while waiting for the workers: stopped", signal.Signals(signals[0]).name)
        return 128 + signals[0]
    except Exception as exc:  # the workers did not come within --startup-timeout-s, or refused
        logger.error("not serving: %s", exc)
        return STARTUP_FAILURE
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose drain (SIGTERM, SIGINT) ends the requests still open shortly before
    its grace runs out, each with a 503 in OpenAI's shape (a stream: an error event, then [DONE]),
    which a client can retry elsewhere. uvicorn itself cancels them when the grace ends, before the
    lifespan's shutdown (Pipeline.close) could say anything: a stream stopped mid-body with no error
    event and no [DONE] ("incomplete chunked read"), a plain request got a text/plain 500."""

    async def shutdown(self, sockets=None) -> None:
        grace_s = self.config.timeout_graceful_shutdown
        if grace_s is None:  # uvicorn waits for open requests without end: nothing to fail
            await super().shutdown(sockets)
            return
        fail_after_s = max(grace_s - min(DRAIN_FAIL_MARGIN_S, grace_s / 2), 0.0)
        timer = asyncio.get_running_loop().call_later(fail_after_s, self._fail_open_requests, fail_after_s)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _fail_open_requests(self, after_s: float) -> None:
        pipeline = getattr(self.config.app.state, "pipeline", None)
        if pipeline is None:
            return
        if pipeline.num_live_requests:
            logger.warning("drain: %d request(s) still open %.3g s into --drain-grace-s %g: ended with a 503",
                           pipeline.num_live_requests, after_s, self.config.timeout_graceful_shutdown)
        # Those still being tokenized, say, fail as they reach the pipeline.
        pipeline.fail_open_requests("the gateway is shutting down (--drain-grace-s ran out)")


async def serve(config: Config) -> int:
    app = create_app(config, freeze_heap=True)
    # On SIGTERM uvicorn stops accepting, lets open requests (streams included) finish for up to
    # drain_grace_s (DrainingServer ends those still open with a 503 just before), then runs the
    # lifespan's shutdown.
    server = DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=config.drain_grace_s,
        # h11, even where httptools is installed (uvicorn's "auto" would take it): httptools drops
        # the body of a POST that offers an upgrade (Java's HttpClient and curl --http2 send
        # "Upgrade: h2c"; uvicorn #2722, httptools #124) and sets no limit on a header's size. It
        # was 0.37 ms faster to the first token (README, "TTFT the gateway and the detok worker add").
        http="h11",
        access_log=False,  # gateway.access logs each request with latency and token counts
        ssl_certfile=config.tls_cert_file or None, ssl_keyfile=config.tls_key_file or None))
    try:
        server.config.load()  # what uvicorn checks at its start (the TLS files), before the wait, not after
    except (OSError, ssl.SSLError) as exc:  # ssl's own errors name no file
        logger.error("not serving: --tls-cert-file %s / --tls-key-file %s: %s", config.tls_cert_file,
                     config.tls_key_file, exc)
        return 1
    stopped = await connect_unless_stopped(config, app)
    if stopped is not None:
        return stopped
    with LoopWatchdog(config.loop_stall_exit_s):
        await server.serve()
    return 0 if server.started else STARTUP_FAILURE


def main() -> None:
    exit_with_the_stack()  # started by `python -m tokenwire.stack`: end with it
    config = parse_config(Config, env_prefix=ENV_PREFIXES["gateway"])
    pause_collections_until_frozen()  # the app's lifespan freezes the heap once the workers answer
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_io_note()
    use_serving_slice(config, "gateway", whole_process=True)  # uvicorn and gRPC start theirs later: they inherit it
    try:
        code = asyncio.run(serve(config))
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it drained on again (uvicorn.run swallowed it)
        code = 128 + signal.SIGINT
    raise SystemExit(code)


if __name__ == "__main__":
    main()
