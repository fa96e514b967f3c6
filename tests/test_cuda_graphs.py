"""Decode steps through DecodeGraphRunner: padded to captured batch sizes and context widths,
read from static buffers. On a CPU the same padded forward runs without capture, so these
tests check the buffers, the padding and the buckets against transformers; the capture itself
is checked on CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from model_worker.config import Config
from model_worker.cuda_graphs import (
    MAX_CAPTURE_BATCH,
    DecodeGraphRunner,
    capture_batch_sizes,
    capture_widths,
)
from model_worker.engine import LLMEngine
from model_worker.model_runner import ModelRunner
from model_worker.sequence import SamplingParams
from tests.test_model_gpt2 import tiny_gpt2
from tests.test_model_hf_fallback import tiny_model
from tests.test_model_llama_variants import WINDOW, tiny
from tests.tiny_hf_models import PROMPTS, engine_greedy

CPU = torch.device("cpu")


def test_capture_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_batch_sizes(1000)[-2:] == [MAX_CAPTURE_BATCH - 8, MAX_CAPTURE_BATCH]
    assert capture_widths(3) == [3]
    assert capture_widths(4) == [4]
    assert capture_widths(5) == [4, 5]
    assert capture_widths(128) == [4, 8, 16, 32, 64, 128]


def record_buckets(graphs: DecodeGraphRunner) -> list[tuple[int, int, int]]:
    """(sequences, bucket batch size, bucket width) of every run() from now on."""
    seen: list[tuple[int, int, int]] = []
    run = graphs.run

    def recording(decodes, input_ids):
        bucket = graphs.bucket(len(decodes), max(c for _, c in decodes))
        assert bucket is not None
        seen.append((len(decodes), *bucket))
        return run(decodes, input_ids)

    graphs.run = recording
    return seen


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    return {
        "llama": lambda: tiny(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("llama"), tiny_model_dir),
        "mistral_window": lambda: tiny(MistralConfig, MistralForCausalLM, tmp_path_factory.mktemp("mistral"),
                                       tiny_model_dir, sliding_window=WINDOW),
        "gpt2": lambda: tiny_gpt2(tmp_path_factory.mktemp("gpt2"), tiny_model_dir),
    }


# Prompts of 5, 9 and 13 tokens that stop after 30, 18 and 6 new tokens: decode batches of 3
# (padded to 4), 2 and 1, whose longest context crosses 16 and 32 positions (widths 4, 8, 16
# of 4-token blocks).
STAGGERED = [(list(range(100, 105)), 30), (list(range(200, 209)), 18), (list(range(300, 313)), 6)]


def assert_staggered_greedy_matches_transformers(runner: ModelRunner, model) -> None:
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=64, max_waiting_requests=8)
    for i, (prompt, max_tokens) in enumerate(STAGGERED):
        engine.add_request(i, prompt, SamplingParams(logprobs=True), max_tokens=max_tokens, stop_token_ids=[],
                           ignore_eos=True)
    outputs: dict[int, list] = {i: [] for i in range(len(STAGGERED))}
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq_id].append(out)
    for i, (prompt, max_tokens) in enumerate(STAGGERED):
        tokens = [o.token_id for o in outputs[i]]
        assert len(tokens) == max_tokens
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens[:-1]])).logits[0].log_softmax(-1)  # [len - 1, V]
        for j, out in enumerate(outputs[i]):
            row = ref[len(prompt) - 1 + j]
            assert int(row.argmax()) == out.token_id, (i, j)
            assert out.logprob == pytest.approx(float(row[out.token_id]), abs=1e-4), (i, j)


@pytest.mark.parametrize("arch", ["llama", "mistral_window", "gpt2"])
def test_padded_static_decode_matches_transformers(models, arch):
    model, model_dir = models[arch]()
    runner = ModelRunner(model_dir, "auto", CPU, torch.float32, max_num_seqs=8, max_model_len=128, block_size=4,
                         decode_graphs=True)
    graphs = runner.decode_graphs
    assert graphs is not None and not graphs.capture and graphs.widths == [4, 8, 16, 32]
    seen = record_buckets(graphs)
    assert_staggered_greedy_matches_transformers(runner, model)
    assert {(n, batch) for n, batch, _ in seen} == {(3, 4), (2, 2), (1, 1)}
    assert {width for _, _, width in seen} == {4, 8, 16}
    # Padding rows wrote into the padding block only, which the block manager never hands out.
    kv = runner.kv_cache
    assert kv.key.shape[1] == kv.num_blocks + 1 and kv.padding_slot == kv.num_blocks * kv.block_size
    assert kv.key[:, kv.num_blocks].abs().sum() > 0
    assert LLMEngine(runner, [], 8, 16, 16).block_manager.num_blocks == kv.num_blocks


def test_prefill_steps_run_eagerly_and_outputs_equal_the_plain_runner(tiny_model_dir):
    plain = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=64)
    padded = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=64,
                         decode_graphs=True)
    seen = record_buckets(padded.decode_graphs)
    reference = engine_greedy(plain, PROMPTS, max_tokens=6, step_budget=7)
    outputs = engine_greedy(padded, PROMPTS, max_tokens=6, step_budget=7)
    # 4 prompts, 6 tokens each: the steps that prefill (the 37-token prompt in 6 chunks) run eagerly.
    assert 0 < len(seen) < sum(len(o) for o in outputs.values())
    for i in reference:
        assert [o.token_id for o in outputs[i]] == [o.token_id for o in reference[i]]
        for got, want in zip(outputs[i], reference[i], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-5)


def test_transformers_fallback_and_batch_invariance_refuse_graphs(tiny_model_dir, tmp_path):
    _, neox_dir = tiny_model(tmp_path, tiny_model_dir, "GPTNeoXForCausalLM")
    with pytest.raises(ValueError, match="only for natively run architectures"):
        ModelRunner(neox_dir, "auto", CPU, torch.float32, max_num_seqs=4, max_model_len=64, decode_graphs=True)
    with pytest.raises(ValueError, match="batch-invariant"):
        ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=64,
                    batch_invariant=True, decode_graphs=True)
    # The model worker's flag (on by default) applies on CUDA only, and never with --batch-invariant.
    assert Config().decode_graphs_on("cuda") and not Config().decode_graphs_on("cpu")
    assert not Config(batch_invariant=True).decode_graphs_on("cuda")
    assert not Config(cuda_graphs=False).decode_graphs_on("cuda")
    # A transformers-fallback model gets none by default, where ModelRunner refuses graphs for it.
    assert not Config().decode_graphs_on("cuda", native_model=False)


def test_graph_runner_needs_a_padding_block(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="padding block"):
        DecodeGraphRunner(runner.model, runner.kv_cache, 4, 64, runner.vocab_size, CPU)


class ForwardGraph:
    """What a faithful capture replays: the bucket's forward on whatever the buffers hold now."""

    def __init__(self, graphs: DecodeGraphRunner, batch: int, width: int) -> None:
        self.graphs, self.batch, self.width = graphs, batch, width

    def replay(self) -> None:
        self.graphs._logits[:self.batch].copy_(self.graphs._forward(self.batch, self.width))


class FrozenInputsGraph(ForwardGraph):
    """A broken capture: positions, slots, lengths and block tables stay as they were at
    capture (only the token ids follow), the bug the startup check must catch."""

    def __init__(self, graphs: DecodeGraphRunner, batch: int, width: int) -> None:
        super().__init__(graphs, batch, width)
        self.frozen = graphs._static.clone()

    def replay(self) -> None:
        live = self.graphs._static.clone()
        m = self.graphs._max_batch
        self.graphs._static[m:] = self.frozen[m:]
        try:
            super().replay()
        finally:
            self.graphs._static.copy_(live)


@pytest.mark.parametrize("graph_class, faithful", [(ForwardGraph, True), (FrozenInputsGraph, False)])
def test_startup_check_catches_a_graph_that_ignores_its_inputs(tiny_model_dir, graph_class, faithful):
    runner = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=8, max_model_len=64, block_size=4,
                         decode_graphs=True)
    graphs = runner.decode_graphs
    for batch in (1, 8):
        graphs._fill([], [], batch, 16)  # what capture sees: padding only
        graphs._graphs[(batch, 16)] = graph_class(graphs, batch, 16)
    if faithful:
        assert graphs.check_replays() == 0.0
    else:
        with pytest.raises(RuntimeError, match="differs from the eager forward"):
            graphs.check_replays()
    # The check leaves the cache as the engine expects it: all zeros.
    assert not runner.kv_cache.key.any() and not runner.kv_cache.value.any()


@pytest.mark.gpu
def test_captured_graphs_replay_the_eager_decode(tiny_model_dir):
    cuda = torch.device("cuda")
    eager = ModelRunner(tiny_model_dir, "dummy", cuda, torch.bfloat16, max_num_seqs=8, max_model_len=128, block_size=4)
    captured = ModelRunner(tiny_model_dir, "dummy", cuda, torch.bfloat16, max_num_seqs=8, max_model_len=128,
                           block_size=4, decode_graphs=True)
    graphs = captured.decode_graphs
    assert graphs is not None and graphs.capture
    assert graphs.num_graphs == len(graphs.batch_sizes) * len(graphs.widths)
    assert graphs.check_replays(seeds=(2, 3)) < 0.02
    seen = record_buckets(graphs)
    reference = engine_greedy(eager, PROMPTS, max_tokens=8, step_budget=7)
    outputs = engine_greedy(captured, PROMPTS, max_tokens=8, step_budget=7)
    assert seen
    for i in reference:
        assert [o.token_id for o in outputs[i]] == [o.token_id for o in reference[i]]
        for got, want in zip(outputs[i], reference[i], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=0.05)
