"""bench/ttft_added.py: the summary's arithmetic, and a short run against the stack on the tiny model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.prompts import make_prompts
from bench.ttft_added import GenerateClient, TTFTAdded, main, measure
from tests.conftest import tiny_stack


def test_summary_gives_each_paths_percentiles_and_what_http_adds():
    result = TTFTAdded(http=[0.030, 0.034, 0.050], grpc=[0.027, 0.029, 0.031])
    summary = result.summary()
    assert summary["requests_per_path"] == 3
    assert summary["http_p50_ms"] == pytest.approx(34.0)
    assert summary["grpc_p50_ms"] == pytest.approx(29.0)
    assert summary["added_p50_ms"] == pytest.approx(5.0)
    # Paired differences 3, 5 and 19 ms: their median, not the difference of medians.
    assert summary["added_paired_p50_ms"] == pytest.approx(5.0)
    # numpy's linear p90 (34 + 0.8 x 16), as bench.metrics takes it; the nearest-rank one was the maximum.
    assert summary["http_p90_ms"] == pytest.approx(46.8)
    assert summary["grpc_p90_ms"] == pytest.approx(30.6)


def test_summary_pairs_request_by_request():
    result = TTFTAdded(http=[0.010, 0.040], grpc=[0.009, 0.020])
    assert result.summary()["added_paired_p50_ms"] == pytest.approx(10.5)  # median of 1 and 20 ms
    with pytest.raises(ValueError):
        TTFTAdded(http=[0.01], grpc=[]).summary()


@pytest.mark.slow
def test_measure_through_the_gateway_and_straight_to_the_model_worker(tiny_model_dir: Path, smollm2):
    prompts = make_prompts(smollm2, 8, 8, seed=3)
    with tiny_stack(tiny_model_dir, 64) as stack:
        result = asyncio.run(measure(f"{stack.gateway_url}/v1", stack.model_worker_address, prompts,
                                     max_tokens=3, gap_s=0.0, warmup=1))
        assert len(result.http) == len(result.grpc) == 3  # 4 pairs, the first one warm-up
        for ttft in result.http + result.grpc:
            assert 0 < ttft < 30

        async def too_long() -> None:
            client = GenerateClient(stack.model_worker_address)
            try:
                await client.ttft("too-long", list(range(100, 200)), 3)  # 100 tokens > max_model_len 64
            finally:
                await client.close()

        # A refused request fails the run with the model worker's reason instead of hanging it.
        with pytest.raises(RuntimeError, match="too-long failed"):
            asyncio.run(too_long())


@pytest.mark.slow
def test_stand_in_rounds_measure_the_serving_path_alone(smollm2_dir: Path, tmp_path: Path):
    """--stand-in: the real gateway and detok worker in front of a model worker with no model, and
    both paths on it; every round's TTFTs kept in the JSON."""
    out = tmp_path / "ttft.json"
    assert main(["--stand-in", "--model", str(smollm2_dir), "--requests", "3", "--warmup", "1", "--gap-ms", "1",
                 "--rounds", "2", "--json", str(out)]) == 0
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds) == 2
    for run in rounds:
        assert len(run["ttft_s"]["http"]) == len(run["ttft_s"]["grpc"]) == 3
        assert all(0 < ttft < 5 for ttft in run["ttft_s"]["http"] + run["ttft_s"]["grpc"])
        assert run["summary"]["requests_per_path"] == 3


def test_each_round_has_prompts_and_request_ids_of_its_own(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]):
    """A round on the prompts of the round before would find them in the prefix cache."""
    seen = []

    async def fake_measure(base_url, model_worker, prompts, max_tokens, gap_s, warmup, model=None, id_prefix="ttft"):
        seen.append(([tuple(p.token_ids) for p in prompts], id_prefix))
        return TTFTAdded(http=[0.003, 0.004], grpc=[0.001, 0.001])

    monkeypatch.setattr("bench.ttft_added.measure", fake_measure)
    assert main(["--base-url", "http://127.0.0.1:9/v1", "--model-worker", "127.0.0.1:9", "--model", str(smollm2_dir),
                 "--requests", "2", "--warmup", "1", "--rounds", "3"]) == 0
    assert len(seen) == 3
    prompts = [p for round_prompts, _ in seen for p in round_prompts]
    assert len(prompts) == 3 * 2 * 3 == len(set(prompts))  # (requests + warmup) pairs per round, all different
    assert len({prefix for _, prefix in seen}) == 3
    assert capsys.readouterr().out.count("added 2.50 ms") == 3


@pytest.mark.parametrize("argv", [
    ["--stand-in", "--threads", "4"],
    ["--stand-in", "--tokenwire-args", "--max-num-seqs 4"],
    ["--step-ms", "2"],
    ["--base-url", "http://h/v1", "--model-worker", "h:1", "--stand-in"],
    ["--base-url", "http://h/v1", "--model-worker", "h:1", "--threads", "2"],
    ["--rounds", "0"],
])
def test_options_that_would_do_nothing_are_refused(argv: list[str]):
    with pytest.raises(SystemExit):
        main(argv)
