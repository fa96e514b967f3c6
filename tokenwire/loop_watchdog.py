"""Ends a service whose event loop has stopped turning, so that whatever supervises it starts a new one.

The gateway and the detok worker do all their work on one asyncio loop. A loop that stops (a bug
that never yields, a C call that never returns) answers nothing, its health check included.
Kubernetes' liveness probe and tokenwire.stack kill such a process, but compose's health check only
marks it unhealthy, and a process run by hand (or by systemd with Restart=on-failure) waits forever.
So the loop notes the time every second, and a thread of the watchdog's own looks: once the loop
has not for --loop-stall-exit-s, it writes every thread's stack to stderr and ends the process with
status 1, for the restart policy (compose's `restart: unless-stopped`) to start it again.

A thread rather than faulthandler's timer (which the model worker's hung-step exit uses): that
timer's clock runs on while the process is paused (SIGSTOP, `docker pause`), so it fired the
moment a long pause ended, before the loop could note anything. The thread sees its own sleep
overrun by as much and gives the loop a new start instead. What it cannot see is a C call that
holds the GIL for good (the thread needs the GIL to look); the health checks of tokenwire.stack and
Kubernetes still end that one.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import sys
import threading
import time
from dataclasses import field
from typing import Any

DEFAULT_STALL_EXIT_S = 60.0
BEAT_PERIOD_S = 1.0


def stall_exit_field() -> Any:
    """The --loop-stall-exit-s flag, as the gateway's and the detok worker's Configs declare it."""
    return field(default=DEFAULT_STALL_EXIT_S, metadata={
        "help": "exit (status 1, every thread's stack on stderr) once the event loop has not turned for this many "
                "seconds, for a supervisor to restart the service (compose's health check only marks it "
                "unhealthy); 0: never"})


def check_stall_exit_s(value: float) -> None:
    if not (value == 0 or value >= 2 * BEAT_PERIOD_S):
        raise ValueError(f"--loop-stall-exit-s must be 0 or at least {2 * BEAT_PERIOD_S:g}, not {value}")


class LoopWatchdog:
    """`with LoopWatchdog(stall_exit_s):` around a service's serving: the loop notes the time every
    period_s, the watchdog's thread looks as often, and both stop on exit. stall_exit_s 0: nothing."""

    def __init__(self, stall_exit_s: float, period_s: float = BEAT_PERIOD_S) -> None:
        self.stall_exit_s = stall_exit_s
        self.period_s = period_s
        self.last_beat = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._stopped = threading.Event()

    def __enter__(self) -> LoopWatchdog:
        if self.stall_exit_s:
            self.last_beat = time.monotonic()
            self._task = asyncio.get_running_loop().create_task(self._beat())
            threading.Thread(target=self._watch, name="loop-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _beat(self) -> None:
        while True:
            self.last_beat = time.monotonic()
            await asyncio.sleep(self.period_s)

    def _watch(self) -> None:
        # A sleep that overran by this much was a pause of the whole process, not of the loop alone.
        paused_s = min(self.stall_exit_s / 2, 5.0)
        looked = time.monotonic()
        while not self._stopped.wait(self.period_s):
            now = time.monotonic()
            if now - looked - self.period_s > paused_s:
                self.last_beat = now  # the loop was paused with us: it gets a new start
            elif now - self.last_beat > self.stall_exit_s and not self._stopped.is_set():
                self._exit(now - self.last_beat)
            looked = now

    def _exit(self, stalled_s: float) -> None:
        print(f"tokenwire: the event loop has not turned for {stalled_s:.0f}s (--loop-stall-exit-s "
              f"{self.stall_exit_s:g}): exiting with status 1 to be restarted; every thread's stack:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1)  # not sys.exit: the stalled loop's thread cannot be stopped or joined
