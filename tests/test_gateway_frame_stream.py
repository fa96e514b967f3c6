"""FrameStream: a callback raising ResetStream ends the call and opens a new one (on_lost runs
once), while any other error in a frame's dispatch is logged and the stream goes on."""

from __future__ import annotations

import asyncio

import grpc

from gateway.frame_stream import FrameStream, ResetStream


class FakeChannel:
    async def channel_ready(self) -> None:
        return None


class FakeCall:
    """Replies 'boom', 'reset', then waits forever (a live stream)."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.cancelled = False

    async def read(self) -> str | object:
        if self.replies:
            return self.replies.pop(0)
        await asyncio.Event().wait()
        return grpc.aio.EOF

    async def write(self, frame: object) -> None:
        return None

    def cancel(self) -> None:
        self.cancelled = True


async def test_reset_stream_reopens_and_other_errors_do_not() -> None:
    calls: list[FakeCall] = []
    seen: list[str] = []
    lost: list[Exception] = []

    def open_call() -> FakeCall:
        calls.append(FakeCall(["boom", "reset", "after"] if not calls else ["fresh"]))
        return calls[-1]

    def on_frame(frame: str) -> None:
        seen.append(frame)
        if frame == "boom":
            raise ValueError("a bug in one frame's dispatch")
        if frame == "reset":
            raise ResetStream("the worker cannot read what we send")

    stream: FrameStream[object, str] = FrameStream("test", FakeChannel(), open_call, lambda: None, on_frame,
                                                   lost.append, reconnect_delay_s=0.01)
    stream.launch()
    for _ in range(200):
        if seen[-1:] == ["fresh"]:
            break
        await asyncio.sleep(0.01)
    await stream.close()
    assert seen == ["boom", "reset", "fresh"]  # "after" was never read: the first call ended at the reset
    assert len(calls) == 2 and calls[0].cancelled
    assert len(lost) == 1 and isinstance(lost[0], ResetStream)
