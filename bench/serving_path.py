"""The serving path alone: CPU per streamed token of the gateway, the detok worker and the client.

    python -m bench.serving_path --concurrency 32 --output-tokens 200 --waves 3 --step-ms 25

Starts the real gateway and detok worker in front of bench/stand_in_model_worker.py (no model:
it gives every running request one token per --step-ms, all in one TokenFrame, as the engine's
decode steps do), runs `bench.loadgen` against the gateway, and reads each process's CPU time
(/proc; the load generator's own, over its requests only) over the run. On a 2-core host the real engine keeps both
cores busy and a profile of the gateway then mostly shows it waiting for a core; here nothing
competes, so the CPU figures and a py-spy of the gateway show the path's own cost. Each service's
CPU per token is what the engine would lose to it (and more: issue 4's notes in README measure the
amplification).

The default --step-ms 25 is the real engine's decode step at 32 streams on this host.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.metrics import process_cpu_seconds
from tokenwire.stack import start_stack


@dataclass
class ServingPathRun:
    concurrency: int
    output_tokens: int  # streamed tokens counted over the measured run
    wall_s: float
    tokens_per_s: float
    # microseconds of CPU per streamed token, each process whole (all its threads)
    gateway_us: float
    detok_worker_us: float
    stand_in_model_worker_us: float
    load_generator_us: float


def run_once(base_url: str, pids: dict[str, int], loadgen_args: list[str], concurrency: int,
             output_tokens: int, waves: int) -> ServingPathRun:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "loadgen.json"
        argv = [sys.executable, "-m", "bench.loadgen", "--base-url", base_url, "--prompt-format", "ids",
                "--concurrency", str(concurrency), "--output-tokens", str(output_tokens), "--waves", str(waves),
                "--warmup-requests", "0", "--json", str(report_path), *loadgen_args]
        client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # The services' CPU from the load generator's first request to its last: its own start-up
        # (imports, the tokenizer) happens before, and the services idle through it.
        before = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        output, _ = client.communicate()
        after = {name: process_cpu_seconds(pid) for name, pid in pids.items()}
        if client.returncode != 0 or not report_path.is_file():
            raise RuntimeError(f"bench.loadgen exited with {client.returncode}:\n{output}")
        (level,) = json.loads(report_path.read_text())["levels"]
    if level["completed"] != level["num_requests"]:
        raise RuntimeError(f"bench.loadgen finished {level['completed']} of {level['num_requests']} requests:\n{output}")
    num_tokens = level["total_output_tokens"]

    def per_token(seconds: float) -> float:
        return round(seconds / num_tokens * 1e6, 1)

    return ServingPathRun(concurrency, num_tokens, round(level["duration_s"], 2), round(level["output_throughput"], 1),
                          per_token(after["gateway"] - before["gateway"]),
                          per_token(after["detok_worker"] - before["detok_worker"]),
                          per_token(after["model_worker"] - before["model_worker"]), per_token(level["client_cpu_s"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--waves", type=int, default=3, help="requests per run: waves x concurrency")
    parser.add_argument("--rounds", type=int, default=1, help="measured runs, one after another")
    parser.add_argument("--step-ms", type=float, default=25.0, help="the stand-in model worker's step")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the stand-in sends a request's tokens every N steps, as the model worker's flag")
    parser.add_argument("--model", help="whose tokenizer the stand-in serves (a model dir or name); "
                                            "default: the model worker's default model")
    parser.add_argument("--json", dest="json_out", help="write the runs here")
    parser.add_argument("--gateway-arg", action="append", default=[],
                        help="one more gateway flag (repeatable), e.g. --gateway-arg=--request-timeout-s=0")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    stand_in_args = ["--step-ms", str(args.step_ms), "--stream-interval", str(args.stream_interval),
                     *(["--model", args.model] if args.model else [])]
    with start_stack(stand_in_args, gateway_args=args.gateway_arg,
                     model_worker_module="bench.stand_in_model_worker", timeout_s=120) as stack:
        pids = {service.name: service.process.pid for service in stack.services}
        base_url = f"{stack.gateway_url}/v1"
        loadgen_args = ["--prompt-len", str(args.prompt_len)]
        # A first short run warms every path (connections, the detok worker's tokenizer tables).
        run_once(base_url, pids, loadgen_args, args.concurrency, 8, 1)
        for _ in range(args.rounds):
            run = run_once(base_url, pids, loadgen_args, args.concurrency, args.output_tokens, args.waves)
            print(f"{run.concurrency} streams, step {args.step_ms:g} ms: {run.tokens_per_s} tok/s; CPU per token: "
                  f"gateway {run.gateway_us} us, detok worker {run.detok_worker_us}, "
                  f"stand-in model worker {run.stand_in_model_worker_us}, load generator {run.load_generator_us}",
                  flush=True)
            runs.append(run)
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"step_ms": args.step_ms, "runs": [asdict(run) for run in runs]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
