"""tokenwire/grpc_server.py: a client that cancels a stream while the server is sending to it
leaves one INFO line in the server's log, not grpc's ERROR with a traceback."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from tokenwire.grpc_server import CallEndedWhileSendingFilter, quiet_calls_ended_while_sending

CYGRPC = "grpc._cython.cygrpc"


async def _cancel_a_stream_being_sent_to() -> None:
    async def endless(request_iterator, context):
        while True:  # 1 MiB messages until the client's window is full and the write waits
            yield b"x" * (1 << 20)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Endless": grpc.stream_stream_rpc_method_handler(endless)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/t.T/Endless")(iter(()))
            await call.read()
            await asyncio.sleep(0.5)  # the server is now blocked sending
            call.cancel()
            await asyncio.sleep(0.5)
    finally:
        await server.stop(0)


@pytest.fixture
def unfiltered():
    logger = logging.getLogger(CYGRPC)
    kept = [f for f in logger.filters if isinstance(f, CallEndedWhileSendingFilter)]
    for f in kept:
        logger.removeFilter(f)
    yield
    for f in kept:
        logger.addFilter(f)


async def test_grpc_logs_an_error_with_a_traceback_when_a_call_ends_mid_send(unfiltered, caplog) -> None:
    # What the filter is for: without it, the client's cancel reads as the server's fault.
    caplog.set_level(logging.INFO, logger=CYGRPC)
    await _cancel_a_stream_being_sent_to()
    errors = [r for r in caplog.records if r.name == CYGRPC and r.levelno >= logging.ERROR]
    assert errors and errors[0].exc_info is not None
    assert errors[0].getMessage().startswith(CallEndedWhileSendingFilter.PREFIX)


async def test_with_the_filter_it_is_one_info_line_naming_the_method(unfiltered, caplog) -> None:
    quiet_calls_ended_while_sending()
    quiet_calls_ended_while_sending()  # once only, however many servers start
    assert sum(isinstance(f, CallEndedWhileSendingFilter) for f in logging.getLogger(CYGRPC).filters) == 1
    caplog.set_level(logging.INFO, logger=CYGRPC)
    await _cancel_a_stream_being_sent_to()
    records = [r for r in caplog.records if r.name == CYGRPC]
    assert records and all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert records[0].getMessage() == "a call ended while a message was being sent to it: [/t.T/Endless]"


def test_other_grpc_records_pass_unchanged() -> None:
    record = logging.LogRecord(CYGRPC, logging.ERROR, __file__, 1, "Unexpected [%s] raised by servicer method",
                               ("ValueError",), None)
    assert CallEndedWhileSendingFilter().filter(record)
    assert (record.levelno, record.getMessage()) == (logging.ERROR, "Unexpected [ValueError] raised by servicer method")
