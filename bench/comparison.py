"""The side-by-side table and issue 4's targets, computed from the systems' reports.

Pure: side_by_side runs the systems and hands their report dicts here.
"""

from __future__ import annotations

from typing import Any

from bench.report import level_x
from bench.workload import Workload

# Report key -> label, in the order they run and print.
SYSTEMS = {
    "tokenwire": "tokenwire (gateway)",
    "model_worker": "tokenwire model worker over gRPC",
    "engine": "tokenwire engine alone",
    "hf_static": "transformers generate (static)",
    "hf_continuous": "transformers generate_batch",
    "llama_cpp": "llama-cpp-python server",
}
BASELINE = "hf_static"


def levels_by_x(report: dict[str, Any]) -> dict[float, dict[str, Any]]:
    return {level_x(level): level for level in report["levels"]}


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from repeated runs of a system: at each level the run with the most output
    tok/s (on a shared machine the slower runs measure the neighbours, not the system) among
    those where no request failed (a round that lost requests measured a lighter load), plus
    every run's tok/s under `output_throughput_runs` so the spread stays visible."""
    merged = {**runs[-1], "repeats": len(runs)}
    per_x: dict[float, list[dict[str, Any]]] = {}
    for run in runs:
        for x, level in levels_by_x(run).items():
            per_x.setdefault(x, []).append(level)
    merged["levels"] = [
        {**max(levels, key=lambda lv: (not lv.get("failed"), lv["output_throughput"])),
         "output_throughput_runs": [lv["output_throughput"] for lv in levels]}
        for _, levels in sorted(per_x.items())
    ]
    errors = [run["error"] for run in runs if run.get("error")]
    merged["error"] = errors[-1] if errors and not merged["levels"] else None
    return merged


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def comparison_table(reports: dict[str, dict[str, Any]], workload: Workload) -> str:
    """A markdown table: one row per (level, system) with tok/s (best of the repeats, then the
    range of all of them), the ratio to transformers static generate at the same level, and
    TTFT / TPOT / ITL of the best run."""
    xs = list(workload.request_rate or workload.concurrency)
    x_name = "req/s" if workload.request_rate else "concurrency"
    baseline = levels_by_x(reports[BASELINE]) if BASELINE in reports else {}
    lines = [f"| {x_name} | system | output tok/s | vs static generate | req/s | TTFT p50 ms | TTFT p99 ms "
             "| TPOT p50 ms | ITL p50 ms | ITL p99 ms | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in xs:
        base = baseline.get(x)
        for system, label in SYSTEMS.items():
            level = levels_by_x(reports[system]).get(x) if system in reports else None
            if level is None:
                continue
            tput = level["output_throughput"]
            ratio = f"{tput / base['output_throughput']:.2f}x" if base and base["output_throughput"] else "-"
            runs = level.get("output_throughput_runs") or [tput]
            spread = f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else ""
            lines.append(f"| {x:g} | {label} | {tput:.1f}{spread} | {ratio} | {level['request_throughput']:.2f} "
                         f"| {_ms(level['ttft_ms']['p50'])} | {_ms(level['ttft_ms']['p99'])} "
                         f"| {_ms(level['tpot_ms']['p50'])} | {_ms(level['itl_ms']['p50'])} "
                         f"| {_ms(level['itl_ms']['p99'])} | {level['completed']}/{level['num_requests']} |")
    return "\n".join(lines)


def _level(reports: dict[str, dict[str, Any]], system: str, x: float) -> dict[str, Any] | None:
    """The system's level at x where every request of it completed: one that lost requests ran a
    lighter load than the others and is no term of a ratio."""
    level = levels_by_x(reports[system]).get(x) if system in reports else None
    return level if level and level["completed"] and not level.get("failed") else None


def _check(name: str, value: float, target: str, met: bool) -> str:
    return f"- {name}: {value:.2f} (target {target}) -> {'met' if met else 'NOT met'}"


def target_checks(reports: dict[str, dict[str, Any]], workload: Workload) -> list[str]:
    """Issue 4's targets as ratios of this run's figures; a check is left out when a system is
    missing or any of its requests at that level failed (the table's ok column shows which)."""
    if workload.request_rate:
        return []
    checks = []
    top = max(workload.concurrency)
    tw, engine = _level(reports, "tokenwire", top), _level(reports, "engine", top)
    static, llama = _level(reports, "hf_static", top), _level(reports, "llama_cpp", top)
    if top > 1 and tw:
        if static:
            checks.append(_check(f"tokenwire / transformers static output tok/s at {top} streams",
                                 tw["output_throughput"] / static["output_throughput"], ">= 3",
                                 tw["output_throughput"] >= 3 * static["output_throughput"]))
        if llama:
            checks.append(_check(f"tokenwire / llama-cpp-python server output tok/s at {top} streams",
                                 tw["output_throughput"] / llama["output_throughput"], ">= 4",
                                 tw["output_throughput"] >= 4 * llama["output_throughput"]))
    if tw and engine:
        checks.append(_check(f"end-to-end / engine-alone output tok/s at {top} streams",
                             tw["output_throughput"] / engine["output_throughput"], ">= 0.95",
                             tw["output_throughput"] >= 0.95 * engine["output_throughput"]))
    one_tw, one_llama, one_engine = (_level(reports, s, 1) for s in ("tokenwire", "llama_cpp", "engine"))
    if one_tw and one_llama and one_tw["tpot_ms"]["p50"] and one_llama["tpot_ms"]["p50"]:
        # Decode speed of one stream: 1 / TPOT, prefill left out.
        checks.append(_check("tokenwire / llama-cpp-python decode tok/s (1 / TPOT p50) at 1 stream",
                             one_llama["tpot_ms"]["p50"] / one_tw["tpot_ms"]["p50"], ">= 1",
                             one_tw["tpot_ms"]["p50"] <= one_llama["tpot_ms"]["p50"]))
    for x in workload.concurrency:
        tw_x, engine_x = _level(reports, "tokenwire", x), _level(reports, "engine", x)
        if tw_x and engine_x:
            added = tw_x["ttft_ms"]["p50"] - engine_x["ttft_ms"]["p50"]
            checks.append(_check(f"TTFT p50 added by gateway + detok (ms) at {x} streams", added, "<= 2",
                                 added <= 2.0))
    return checks
