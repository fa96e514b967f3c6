"""Benchmark reports: one JSON layout for every system measured, and the PNG plot of several.

loadgen, engine_alone and hf_baselines write reports; side_by_side reads them back to tabulate
and plot them together.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.metrics import LevelSummary


def environment() -> dict[str, Any]:
    """Where a figure was measured; timings only compare within one machine and one run."""
    env: dict[str, Any] = {
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    torch = sys.modules.get("torch")  # only where the measured code runs torch (not loadgen's client)
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
    return env


def build_report(label: str, kind: str, config: dict[str, Any], levels: Sequence[LevelSummary],
                 **extra: Any) -> dict[str, Any]:
    """kind: openai (loadgen against a server), model_worker (its Generate stream alone), engine (tokenwire's
    LLMEngine alone), hf_static, hf_continuous."""
    return {"label": label, "kind": kind, "config": config, "environment": environment(),
            "levels": [asdict(level) for level in levels], **extra}


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def save_report(report: dict[str, Any], json_out: str, plot: str, title: str) -> None:
    """Writes the report's JSON and PNG where the command line asked (empty: skip)."""
    if json_out:
        write_report(Path(json_out), report)
        print(f"wrote {json_out}")
    if plot:
        plot_reports([report], Path(plot), title)
        print(f"wrote {plot}")


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def level_x(level: dict[str, Any]) -> float:
    """A level's place on the x axis: its request rate in open-loop mode (whose levels may share a
    --max-concurrency cap), else its concurrency."""
    return level["request_rate"] if level.get("request_rate") is not None else level["concurrency"]


def plot_reports(reports: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Output tok/s and TTFT (p50 solid, p99 dashed) against concurrency, one line per report."""
    import matplotlib

    matplotlib.use("Agg")  # no display on benchmark machines
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    rate_mode = any(level.get("request_rate") is not None for r in reports for level in r["levels"])
    for report in reports:
        levels = sorted(report["levels"], key=level_x)
        xs = [level_x(level) for level in levels]
        line, = ax_tput.plot(xs, [level["output_throughput"] for level in levels], marker="o", label=report["label"])
        timed = [level for level in levels if level["ttft_ms"]["p50"] is not None]
        if timed:
            tx = [level_x(level) for level in timed]
            ax_ttft.plot(tx, [level["ttft_ms"]["p50"] for level in timed], marker="o", color=line.get_color(),
                         label=f"{report['label']} p50")
            ax_ttft.plot(tx, [level["ttft_ms"]["p99"] for level in timed], linestyle="--", color=line.get_color(),
                         label=f"{report['label']} p99")
    xlabel = "request rate (req/s)" if rate_mode else "concurrent requests"
    ticks = sorted({level_x(level) for r in reports for level in r["levels"]})
    for ax in (ax_tput, ax_ttft):
        ax.set_xlabel(xlabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_title("throughput")
    ax_tput.legend(fontsize=8)
    ax_ttft.set_ylabel("time to first token (ms)")
    ax_ttft.set_yscale("log")
    # Labels at 1, 2, 5 x 10^k, written 200 rather than 2x10^2.
    ax_ttft.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_ttft.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_ttft.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_ttft.set_title("TTFT")
    if ax_ttft.lines:
        ax_ttft.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
