"""A long-lived bidirectional gRPC stream with a batching sender and a dispatching reader.

ModelWorkerClient and DetokClient each own one: callers queue items without awaiting, the
sender writes everything queued since its previous write as ONE frame, the reader hands each
reply frame to a callback; when the stream breaks it reports the loss and reconnects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc

logger = logging.getLogger(__name__)

OutFrame = TypeVar("OutFrame")
InFrame = TypeVar("InFrame")


class ResetStream(Exception):
    """Raised by an on_frame callback to end the stream as if it were lost: on_lost runs (its
    owner forgets the stream's state and fails its requests) and a new stream is opened."""


def status_text(error: BaseException) -> str:
    """An RPC's failure as people read it: gRPC's status and details, not AioRpcError's repr (its
    debug string, several lines); other errors by their message."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}" if error.details() else error.code().name
    return str(error) or type(error).__name__


def why_lost(error: Exception) -> str:
    """A lost stream's cause as a client may read it: gRPC's status and details, not the error's
    repr nor the worker's address; FrameStream logs those."""
    if isinstance(error, (grpc.aio.AioRpcError, ResetStream)):  # ResetStream: the gateway's own reason
        return status_text(error)
    return "the worker ended the stream"


class FrameStream(Generic[OutFrame, InFrame]):
    """One bidi call at a time on `channel`, reopened after a failure until close()."""

    def __init__(self, name: str, channel: grpc.aio.Channel, open_call: Callable[[], Any],
                 take_frame: Callable[[], OutFrame | None], on_frame: Callable[[InFrame], None],
                 on_lost: Callable[[Exception], None], reconnect_delay_s: float = 0.5,
                 before_open: Callable[[], Awaitable[None]] | None = None,
                 stalled: Callable[[], str | None] | None = None, stall_check_s: float = 1.0) -> None:
        self.name = name
        self._channel = channel
        self._open_call = open_call
        self._take_frame = take_frame
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._reconnect_delay_s = reconnect_delay_s
        # Awaited on every (re)connect before the call opens; raising keeps the stream closed
        # (e.g. a model worker replica that serves another model) and is retried.
        self._before_open = before_open
        # Polled every stall_check_s while the call is open: a reason ends the call as lost. For a
        # peer whose gRPC core still answers keepalive pings while its own loop hangs (keepalive
        # finds only a stopped process or a dead network).
        self._stalled = stalled
        self._stall_check_s = stall_check_s
        self._wake = asyncio.Event()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wake(self) -> None:
        """Something was queued: the sender takes it (and whatever else is queued by then)."""
        self._wake.set()

    def launch(self) -> None:
        """Starts the stream in the background; it connects (and reconnects) on its own."""
        self._task = asyncio.create_task(self._run(), name=f"{self.name} stream")

    async def wait_connected(self) -> None:
        await self._connected.wait()

    async def start(self, timeout_s: float) -> None:
        """Starts the stream and waits until its first call is open."""
        self.launch()
        assert self._task is not None
        connected = asyncio.create_task(self._connected.wait())
        done, _ = await asyncio.wait({connected, self._task}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        connected.cancel()
        if self._task in done:
            self._task.result()
        if not self.connected:
            raise TimeoutError(f"{self.name}: no stream within {timeout_s:.0f}s")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._channel.channel_ready()
            if self._before_open is not None:
                try:
                    await self._before_open()
                except Exception as exc:  # grpc.aio.AioRpcError, or the check's own refusal
                    logger.warning("%s: not opening the stream (%s); retrying", self.name, exc)
                    await asyncio.sleep(self._reconnect_delay_s)
                    continue
            call = self._open_call()
            self._connected.set()
            logger.info("%s: stream open", self.name)
            try:
                await self._pump(call)
                error: Exception = ConnectionError(f"{self.name} ended the stream")
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:  # grpc.aio.AioRpcError, or a write on a dead call
                error = exc
            self._connected.clear()
            call.cancel()
            logger.warning("%s: stream lost (%s); reconnecting", self.name, error)
            self._on_lost(error)
            await asyncio.sleep(self._reconnect_delay_s)

    async def _pump(self, call: Any) -> None:
        """Runs sender and reader until either ends; returns when the server ended the stream."""
        sender = asyncio.create_task(self._send_loop(call), name=f"{self.name} sender")
        reader = asyncio.create_task(self._read_loop(call), name=f"{self.name} reader")
        tasks = {sender, reader}
        if self._stalled is not None:
            tasks.add(asyncio.create_task(self._watch_stall(), name=f"{self.name} stall watch"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()

    async def _send_loop(self, call: Any) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Everything queued while the previous write was in flight goes out as one frame.
            frame = self._take_frame()
            if frame is None:
                continue
            await call.write(frame)

    async def _watch_stall(self) -> None:
        assert self._stalled is not None
        while True:
            await asyncio.sleep(self._stall_check_s)
            reason = self._stalled()
            if reason is not None:
                raise ResetStream(reason)

    async def _read_loop(self, call: Any) -> None:
        while True:
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
            try:
                self._on_frame(frame)
            except ResetStream:
                raise
            except Exception:
                # A bug in one frame's dispatch must not end every other request of the stream.
                logger.exception("%s: dispatching a frame failed", self.name)


async def wait_any_connected(streams: Sequence[FrameStream[Any, Any]], timeout_s: float) -> bool:
    """Waits (at most timeout_s) until one of the launched streams is connected; whether one is."""
    waits = [asyncio.create_task(stream.wait_connected()) for stream in streams]
    if waits:
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
    return any(stream.connected for stream in streams)
