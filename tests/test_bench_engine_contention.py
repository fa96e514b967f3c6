"""bench.engine_contention on the tiny model: both runs of each round serve every request, the
competitor's share is what it spun, and the ratios follow from the throughputs."""

from __future__ import annotations

import json

import pytest

from bench import engine_contention


def test_rounds_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "contention.json"
    report = engine_contention.main([
        "--concurrency", "2", "--output-tokens", "6", "--prompt-len", "8", "--waves", "2", "--rounds", "2",
        "--busy-ms", "2", "--period-ms", "4", "--json", str(out),
        "--", "--model", str(tiny_model_dir), "--load-format", "dummy", "--max-num-seqs", "4", "--max-model-len", "64",
        "--dtype", "float32", "--device", "cpu", "--num-threads", "1"])
    assert json.loads(out.read_text()) == report
    assert report["workload"] == {"prompt_len": 8, "output_tokens": 6, "concurrency": 2, "num_requests": 4}
    assert len(report["rounds"]) == 2
    for r in report["rounds"]:
        assert r["quiet_tok_s"] > 0 and r["loaded_tok_s"] > 0
        # It spins 2 ms of every 4 (less while it waits for a core): at most half of one CPU.
        assert 0 < r["competitor_machine_share"] <= 0.5 / report["cpus"] + 0.05
        assert r["throughput_loss"] == pytest.approx(1 - r["loaded_tok_s"] / r["quiet_tok_s"])
        assert r["amplification"] == pytest.approx(r["throughput_loss"] / r["competitor_machine_share"])


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--busy-ms", "5", "--period-ms", "5"],
                                   ["--concurrency", "1,2"]])
def test_bad_arguments_are_refused(flags):
    with pytest.raises(SystemExit):
        engine_contention.parse_args(flags)
