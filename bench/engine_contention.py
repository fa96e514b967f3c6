"""What another process on the engine's cores costs the engine alone: its throughput with and
without a synthetic competitor, against the share of the machine the competitor took.

The serving path (gateway, detok worker, the model worker's event loop, the client) shares the
cores with torch's threads on a small host. Each kernel of a step is split between those threads
and ends at a barrier, so a core taken from one thread also idles the other: measured on the
2-core host, a competitor that took ~5% of the machine cost the engine 7-10% (README, Performance,
TTFT). This bench puts a number on it for any host and any engine change:

    python -m bench.engine_contention --concurrency 32 --output-tokens 200 --waves 2 --rounds 2 \
        -- --max-num-seqs 32 --max-model-len 248 --num-threads 2

The competitor is a Python process that spins for --busy-ms of every --period-ms (touching almost
no memory, so it costs the engine cores, not bandwidth). Rounds alternate which run goes first.
`amplification` is the engine's throughput loss divided by the competitor's share of the machine:
1 when the engine loses just the CPU time taken from it, 2 when every ms taken also idles the
other thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/engine_contention.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_alone import EngineDriver, build_engine, parse_with_model_worker_args  # noqa: E402
from bench.metrics import summarize  # noqa: E402
from bench.prompts import load_tokenizer, make_prompts  # noqa: E402
from model_worker.config import Config  # noqa: E402
from tokenwire.config_cli import parse_config  # noqa: E402

SPINNER = """
import sys, time
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(idle)
"""


class Competitor:
    """The spinning process; stop() returns the share of the machine it took over its life (its
    duty cycle is steady, so that is its share during the level too)."""

    def __init__(self, busy_ms: float, period_ms: float, cpus: int) -> None:
        self.cpus = cpus
        self.started = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-c", SPINNER, str(busy_ms), str(period_ms - busy_ms)])

    def stop(self) -> float:
        self.process.kill()
        _, _, usage = os.wait4(self.process.pid, 0)  # exact CPU time, unlike /proc's clock ticks
        self.process.returncode = -9
        return (usage.ru_utime + usage.ru_stime) / ((time.perf_counter() - self.started) * self.cpus)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Flags after -- go to the model worker's Config (python -m model_worker --help).")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (quiet, with the competitor)")
    parser.add_argument("--busy-ms", type=float, default=1.0, help="the competitor spins this long ...")
    parser.add_argument("--period-ms", type=float, default=10.0, help="... once every this many ms")
    parser.add_argument("--json", dest="json_out", default="")
    args = parse_with_model_worker_args(parser, argv)
    if args.rounds < 1 or not 0 < args.busy_ms < args.period_ms:
        parser.error("--rounds must be >= 1 and 0 < --busy-ms < --period-ms")
    if len(list(args.workload.levels())) != 1:
        parser.error("one level: a single --concurrency or --request-rate")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    workload = args.workload
    config = parse_config(Config, args.model_worker_args, env_prefix="TOKENWIRE_MODEL_WORKER_")
    engine, model_dir = build_engine(config)
    pool = make_prompts(load_tokenizer(model_dir), workload.pool_size, workload.prompt_len, workload.seed)
    driver = EngineDriver(engine, workload.output_tokens)
    driver.warm_up(workload.warmup_prompts(pool)[:1])
    (level,) = workload.levels()
    cpus = len(os.sched_getaffinity(0))

    def run(competitor: bool) -> dict:
        spinner = Competitor(args.busy_ms, args.period_ms, cpus) if competitor else None
        share = 0.0
        try:
            if spinner is not None:
                time.sleep(0.2)  # started and spinning before the level
            summary = summarize(driver.run_level(level.prompts(pool), level, workload.seed),
                                level.concurrency, level.request_rate)
        finally:
            if spinner is not None:
                share = spinner.stop()
        if summary.failed:
            raise RuntimeError(f"{summary.failed} requests failed: {summary.errors}")
        return {"competitor": competitor, "output_tok_s": summary.output_throughput, "machine_share": share}

    rounds = []
    for index in range(args.rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        runs = {competitor: run(competitor) for competitor in order}
        quiet, loaded = runs[False], runs[True]
        loss = 1.0 - loaded["output_tok_s"] / quiet["output_tok_s"]
        share = loaded["machine_share"]
        rounds.append({"quiet_tok_s": quiet["output_tok_s"], "loaded_tok_s": loaded["output_tok_s"],
                       "competitor_machine_share": share, "throughput_loss": loss,
                       "amplification": loss / share if share > 0 else None})
        print(f"round {index + 1}: {quiet['output_tok_s']:.1f} tok/s quiet, {loaded['output_tok_s']:.1f} with a "
              f"competitor taking {100 * share:.1f}% of {cpus} CPUs: {100 * loss:.1f}% lost "
              f"(amplification {rounds[-1]['amplification'] or float('nan'):.2f})", flush=True)
    report = {"workload": {"prompt_len": workload.prompt_len, "output_tokens": workload.output_tokens,
                           "concurrency": level.concurrency, "num_requests": level.num_requests},
              "model_worker_args": args.model_worker_args, "busy_ms": args.busy_ms, "period_ms": args.period_ms,
              "cpus": cpus, "rounds": rounds}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
