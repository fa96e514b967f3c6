"""The stalled event loop's exit (tokenwire/loop_watchdog.py): a process whose loop stops ends with
status 1 and every thread's stack, for its supervisor to restart it; a turning loop never does."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from detok_worker.config import Config as DetokConfig
from gateway.config import Config as GatewayConfig
from tokenwire.loop_watchdog import DEFAULT_STALL_EXIT_S, LoopWatchdog

# A service's loop in miniature: the watchdog beside a task that turns for a while, then blocks the
# loop (time.sleep in a coroutine, as a bug that never yields would).
SERVICE = textwrap.dedent("""
    import asyncio, sys, time
    from tokenwire.loop_watchdog import LoopWatchdog

    async def main(turn_s, block_s):
        with LoopWatchdog(2.0, period_s=0.1):
            await asyncio.sleep(turn_s)  # turning: re-armed every 0.1 s, never fires
            print("blocking", flush=True)
            time.sleep(block_s)
        print("went on", flush=True)

    asyncio.run(main(float(sys.argv[1]), float(sys.argv[2])))
""")


# Each service's own serve() with its serving stalled (the server's serve replaced by a sleep that
# holds the loop): the watchdog is running by then. No workers: the gateway's wait for them skipped.
SERVES = {
    "gateway": textwrap.dedent("""
        import asyncio, time
        import gateway.__main__ as main
        from gateway.config import Config

        async def stalled(*args, **kwargs):
            time.sleep(30)

        async def connected(config, app):
            return None

        main.connect_unless_stopped = connected
        main.DrainingServer.serve = stalled
        asyncio.run(main.serve(Config(port=0, loop_stall_exit_s=2)))
    """),
    "detok_worker": textwrap.dedent("""
        import asyncio, time
        import detok_worker.__main__ as main
        from detok_worker.config import Config

        async def stalled(*args, **kwargs):
            time.sleep(30)

        main.serve_until_signal = stalled
        asyncio.run(main.serve(Config(port=0, loop_stall_exit_s=2)))
    """),
}
REPOSITORY = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60,
                          cwd=REPOSITORY)
    return done, time.monotonic() - started


def run_service(turn_s: float, block_s: float) -> tuple[subprocess.CompletedProcess, float]:
    return run_script(SERVICE, str(turn_s), str(block_s))


def test_a_stalled_loop_ends_the_process_with_every_threads_stack() -> None:
    done, took_s = run_service(turn_s=3.0, block_s=30.0)  # turning 3 s is past the 2 s limit: no exit then
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == "blocking\n"
    assert "the event loop has not turned for 2s" in done.stderr
    assert 'File "<string>"' in done.stderr  # every thread's stack: the loop's, at the sleep
    assert 4.5 < took_s < 20, took_s  # 3 s turning, then 2 s stalled (plus the interpreter's start)


@pytest.mark.parametrize("service", SERVES)
def test_each_service_watches_its_loop_while_it_serves(service: str) -> None:
    done, took_s = run_script(SERVES[service])
    assert done.returncode == 1 and "has not turned for 2s" in done.stderr, (done.stdout, done.stderr[-2000:])
    assert "stalled" in done.stderr  # the loop's stack shows where it stopped
    assert took_s < 25, took_s


def test_a_stall_shorter_than_the_limit_is_let_be() -> None:
    done, _ = run_service(turn_s=0.5, block_s=1.0)
    assert (done.returncode, done.stdout, done.stderr) == (0, "blocking\nwent on\n", "")


def test_a_paused_process_is_not_taken_for_a_stalled_loop() -> None:
    """SIGSTOP (or docker pause) for longer than the limit: the loop stopped, but so did everything
    else; once resumed it turns again, and the process serves on (faulthandler's timer, whose clock
    runs on through a pause, ended such a process the moment it resumed)."""
    process = subprocess.Popen([sys.executable, "-c", SERVICE, "6.0", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPOSITORY)
    try:
        time.sleep(2.0)
        process.send_signal(signal.SIGSTOP)
        time.sleep(3.5)  # past the 2 s limit
        process.send_signal(signal.SIGCONT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert (process.returncode, out, err) == (0, "blocking\nwent on\n", "")


async def test_an_exit_leaves_nothing_running() -> None:
    before = threading.active_count()
    with LoopWatchdog(7.0, period_s=0.01) as watchdog:
        assert threading.active_count() == before + 1
        await asyncio.sleep(0.05)
        assert time.monotonic() - watchdog.last_beat < 1
    await asyncio.sleep(0.05)
    assert threading.active_count() == before
    with LoopWatchdog(0):  # off: no thread
        assert threading.active_count() == before


@pytest.mark.parametrize("config", [GatewayConfig, DetokConfig])
def test_the_flag(config: type) -> None:
    assert config().loop_stall_exit_s == DEFAULT_STALL_EXIT_S
    assert config(loop_stall_exit_s=0).loop_stall_exit_s == 0
    with pytest.raises(ValueError, match="--loop-stall-exit-s must be 0 or at least 2"):
        config(loop_stall_exit_s=0.5)
