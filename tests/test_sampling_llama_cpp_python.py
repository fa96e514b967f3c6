"""Our sampler's llama.cpp chain against llama.cpp's own samplers, run through llama-cpp-python on the
same logits (bench/llama_cpp_sampler_parity.py): same kept-token sets, logits and probabilities.

llama-cpp-python compiles llama.cpp, so it lives in its own venv (`make bench-peers`), not in .venv or
CI: set TOKENWIRE_LLAMA_CPP_PYTHON to its python, or have /work/peers-venv or
~/.cache/tokenwire/peers-venv; without one these tests skip.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from bench import llama_cpp_sampler_parity as parity

CASE_NAMES = [c.name for c in parity.default_cases(parity.synthetic_logits(vocab_size=512))]


@pytest.fixture(scope="module")
def peer_python() -> str:
    python = parity.find_peer_python()
    if python is None:
        tried = (f"{parity.PEER_ENV}={os.environ[parity.PEER_ENV]}" if os.environ.get(parity.PEER_ENV)
                 else ", ".join(str(p) for p in parity.PEER_DEFAULTS))
        pytest.skip(f"no Python that imports llama_cpp and numpy (tried {tried}); `make bench-peers` builds one")
    return python


def reports_by_name(logits: np.ndarray, peer_python: str) -> dict[str, parity.CaseReport]:
    return {r.name: r for r in parity.compare(logits, parity.default_cases(logits), peer_python)}


@pytest.fixture(scope="module")
def synthetic_reports(peer_python) -> tuple[np.ndarray, dict[str, parity.CaseReport]]:
    logits = parity.synthetic_logits()
    return logits, reports_by_name(logits, peer_python)


@pytest.fixture(scope="module")
def smollm2_reports(peer_python, smollm2_dir) -> tuple[np.ndarray, dict[str, parity.CaseReport]]:
    logits = parity.smollm2_logits(smollm2_dir, list(parity.PROMPTS), positions=3)
    return logits, reports_by_name(logits, peer_python)


def assert_parity(logits: np.ndarray, report: parity.CaseReport) -> None:
    if report.unsupported:
        pytest.skip(f"{report.name}: {report.unsupported}")
    assert not report.mismatches, "\n".join(report.mismatches)
    exact_rows = [r for r in range(len(report.kept_ours)) if r not in report.rounding_rows]
    assert [report.kept_ours[r] for r in exact_rows] == [report.kept_llama[r] for r in exact_rows]
    # The case must have done something, or agreeing would prove nothing: dropped tokens (a filter)
    # or changed logits (temperature, a penalty, DRY).
    rows, vocab = logits.shape
    assert sum(report.kept_llama) < rows * vocab or report.num_changed > 0
    # Only a lone top-p / typical case may excuse a row as llama.cpp's float32 rounding at the cut
    # (ours is then the float64 answer, checked in parity._rounding_cut), and never most rows.
    if report.rounding_rows:
        assert report.name.startswith(("top_p", "typical_p")), report.rounding_rows
        assert len(report.rounding_rows) <= rows // 2, report.rounding_rows


@pytest.mark.parametrize("name", CASE_NAMES)
def test_synthetic_logits(synthetic_reports, name):
    logits, reports = synthetic_reports
    assert_parity(logits, reports[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", CASE_NAMES)
def test_smollm2_logits(smollm2_reports, name):
    logits, reports = smollm2_reports
    assert_parity(logits, reports[name])


def test_comparison_reports_a_wrong_setting(peer_python):
    """The harness is able to fail: one step of top_k or of temperature off shows up."""
    logits = parity.synthetic_logits(vocab_size=4096)
    cases = [
        parity.Case("top_k_off_by_one", (("top_k", {"k": 40}), ("temp", {"t": 1.0})), {"temperature": 1.0, "top_k": 41}),
        parity.Case("temperature_off", (("temp", {"t": 0.7}),), {"temperature": 0.71}),
    ]
    reports = {r.name: r for r in parity.compare(logits, cases, peer_python)}
    assert any("kept 41 (ours) vs 40 (llama.cpp)" in line for line in reports["top_k_off_by_one"].mismatches)
    assert any("logit of token" in line for line in reports["temperature_off"].mismatches)


def test_dry_sequence_breakers_reach_llama_cpp(peer_python, tmp_path):
    """The DRY cases pass token-id breakers to llama.cpp through a hand-built std::vector: a breaker
    inside the repeated run must shorten the repeat llama.cpp measures, so its penalty shrinks."""
    logits = parity.synthetic_logits(vocab_size=4096)
    by_name = {c.name: c for c in parity.default_cases(logits)}
    cases = [by_name["dry"], by_name["dry_breaker"], by_name["dry_breaker_seq"]]
    out = parity.run_llama_cpp(peer_python, logits, cases, tmp_path)
    if "dry/unsupported" in out:
        pytest.skip(str(out["dry/unsupported"][0]))

    def penalised(name: str) -> dict[int, float]:
        ids, values = out[f"{name}/0/id"], out[f"{name}/0/logit"]
        changed = values != logits[0, ids]
        return {int(t): float(logits[0, t] - v) for t, v in zip(ids[changed], values[changed], strict=True)}

    plain, single, pair = penalised("dry"), penalised("dry_breaker"), penalised("dry_breaker_seq")
    assert plain and single.keys() == plain.keys() and pair.keys() == plain.keys()
    for token, amount in plain.items():
        assert single[token] < amount and pair[token] < amount
