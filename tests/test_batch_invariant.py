"""--batch-invariant's parts: a tiled linear layer gives a row the same bits wherever it sits in
whatever batch, and the flag is refused where it cannot hold. The engine-level check (a seeded
request alone and amid 15 others) is in test_sampling_engine.py."""

from __future__ import annotations

import json

import pytest
import torch

from model_worker.config import Config
from model_worker.model_runner import ModelRunner
from model_worker.models.linear import BATCH_INVARIANT_ROW_TILE, Linear
from tokenwire.config_cli import parse_config

TILE = BATCH_INVARIANT_ROW_TILE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("out_features", "in_features", "with_bias"), [(80, 96, True), (960, 576, False)])
def test_tiled_linear_row_is_the_same_at_every_batch_size_and_tile_position(dtype, out_features, in_features,
                                                                            with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(dtype)
    bias = (torch.randn(out_features, generator=gen) * 0.02).to(dtype) if with_bias else None
    linear = Linear(weight, bias, row_tile=TILE)
    row = torch.randn(1, in_features, generator=gen).to(dtype)
    alone = linear(row)[0]  # [N]
    assert alone.dtype == dtype and alone.shape == (out_features,)
    # Every position within a tile, in first, middle and last (zero-padded) tiles, among random rows.
    batch = 3 * TILE + 5
    others = torch.randn(batch, in_features, generator=gen).to(dtype)
    for pos in range(batch):
        x = others.clone()
        x[pos] = row[0]
        assert torch.equal(linear(x)[pos], alone), f"row at {pos} of {batch}"
    for size in (2, TILE - 1, TILE, TILE + 1):
        x = others[:size].clone()
        x[size - 1] = row[0]
        assert torch.equal(linear(x)[size - 1], alone), f"last row of {size}"


def test_tiled_linear_matches_the_plain_gemm_closely_and_handles_no_rows():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=gen)
    x = torch.randn(37, 64, generator=gen)
    tiled = Linear(weight, row_tile=TILE)
    assert torch.allclose(tiled(x), x @ weight.T, atol=1e-5)
    assert tiled(x[:0]).shape == (0, 48)


def test_flag_parses_and_refuses_int8_small_batch():
    assert parse_config(Config, ["--batch-invariant"], env_prefix="TOKENWIRE_TEST_BI_").batch_invariant
    assert not parse_config(Config, [], env_prefix="TOKENWIRE_TEST_BI_").batch_invariant
    with pytest.raises(ValueError, match="batch-invariant"):
        Config(batch_invariant=True, int8_small_batch=True)
    with pytest.raises(ValueError, match="batch-invariant"):
        Linear(torch.zeros(4, 4, dtype=torch.bfloat16), int8_small_batch=True, row_tile=TILE)


def test_model_runner_refuses_the_flag_for_other_architectures(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_positions": 32, "n_embd": 16,
              "n_layer": 1, "n_head": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Llama family only"):
        ModelRunner(tmp_path, "dummy", torch.device("cpu"), torch.float32, max_num_seqs=2, max_model_len=32,
                    batch_invariant=True)


@pytest.mark.parametrize("packed", [False, True], ids=["topk_then_spill", "packed_keys"])
def test_topk_lowest_id_first_orders_ties_by_id_whatever_k(packed):
    from model_worker.sampling.processors import topk_lowest_id_first

    gen = torch.Generator().manual_seed(2)
    # bfloat16-rounded values: many exact ties, as in logits of a bfloat16 model.
    x = torch.randn(6, 3000, generator=gen).bfloat16().float()
    x[0, [7, 3, 2999, 500]] = 9.0  # a 4-way tie at the top, cut by k = 2 and k = 3
    x[1] = 0.0  # every value tied: more ties than topk's candidates, the full-sort path
    x[2, 10:] = float("-inf")  # a filtered row: fewer finite values than some k
    x[3] = -torch.randint(1, 4, (3000,), generator=gen).float()  # negative values, all tied in threes
    x[4, ::2] = -0.0  # -0.0 and 0.0 compare equal: ties, ordered by id
    x[4, 1::2] = 0.0
    expected_values, expected_ids = x.sort(dim=-1, descending=True, stable=True)
    for k in (1, 2, 3, 5, 20, 3000):
        values, ids = topk_lowest_id_first(x, k, packed)
        assert torch.equal(ids, expected_ids[:, :k]) and torch.equal(values, expected_values[:, :k]), k
    assert topk_lowest_id_first(x, 3, packed)[1][0].tolist() == [3, 7, 500]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_invariant_forward_computes_the_same_model_as_the_default_one(tiny_model_dir, dtype):
    """Not only invariant but right: prompt logprobs (teacher-forced, so no drift) and, in float32,
    greedy tokens and their logprobs agree with the default path (same random weights), through
    chunked prefills beside decodes."""
    from model_worker.engine import LLMEngine
    from model_worker.sequence import SamplingParams

    prompts = [[(7 * i + 13 * j) % 4000 + 5 for j in range(5 + 9 * i)] for i in range(4)]
    results = []
    for batch_invariant in (False, True):
        runner = ModelRunner(tiny_model_dir, "dummy", torch.device("cpu"), dtype, max_num_seqs=4,
                             max_model_len=128, batch_invariant=batch_invariant)
        engine = LLMEngine(runner, [], max_num_seqs=4, max_num_batched_tokens=11, max_waiting_requests=8)
        for i, prompt in enumerate(prompts):
            engine.add_request(i, prompt, SamplingParams(logprobs=True, prompt_logprobs=0), 6, [], True)
        generated: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(prompts))}
        prompt_logprobs: dict[int, list[float]] = {}
        while engine.has_work():
            for out in engine.step():
                if out.token_id is not None:
                    generated[out.seq_id].append((out.token_id, out.logprob))
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.seq_id] = out.prompt_logprobs.logprobs[1:]  # [0] is NaN
        results.append((generated, prompt_logprobs))
    (default, default_prompt), (invariant, invariant_prompt) = results
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for i, prompt in enumerate(prompts):
        assert len(invariant_prompt[i]) == len(prompt) - 1
        assert invariant_prompt[i] == pytest.approx(default_prompt[i], abs=tolerance)
        if dtype == torch.float32:  # in bfloat16 a near tie may flip and the greedy paths part
            assert [t for t, _ in invariant[i]] == [t for t, _ in default[i]]
            assert [lp for _, lp in invariant[i]] == pytest.approx([lp for _, lp in default[i]], abs=tolerance)
