"""The ragged forward: chunked prefill and batched decode equal one plain full forward."""

from __future__ import annotations

import torch

from model_worker.engine import LLMEngine
from model_worker.model_runner import ModelRunner
from model_worker.sequence import SamplingParams

CPU = torch.device("cpu")


def full_forward_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Reference: the whole sequence in one prefill (no cache reads) into blocks that are free
    once the engine is done."""
    from model_worker.attention_metadata import AttentionMetadata

    bs = runner.kv_cache.block_size
    table = list(range(-(-len(tokens) // bs)))
    meta = AttentionMetadata.build([(table, 0, len(tokens))], [], bs, CPU)
    hidden = runner.model.forward(torch.tensor(tokens), meta, runner.kv_cache)
    return runner.model.logits(hidden)


def test_chunked_prefill_and_batched_decode_match_full_forward(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=5, max_model_len=128)
    # A 5-token budget forces the 23-token prompt through 5 chunks next to running decodes.
    engine = LLMEngine(runner, [], max_num_seqs=4, max_num_batched_tokens=5, max_waiting_requests=10)
    prompts = [list(range(3, 26)), [7, 8], [9, 10, 11, 12]]
    for i, p in enumerate(prompts):
        engine.add_request(i, p, SamplingParams(logprobs=True), max_tokens=6, stop_token_ids=[], ignore_eos=True)
    outputs: dict[int, list] = {i: [] for i in range(3)}
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq_id].append(out)
    for i, prompt in enumerate(prompts):
        tokens = prompt + [o.token_id for o in outputs[i]]
        ref = full_forward_logits(runner, tokens[:-1]).log_softmax(-1)  # [len-1, V]
        for j, out in enumerate(outputs[i]):
            row = ref[len(prompt) - 1 + j]
            assert out.token_id == int(row.argmax())
            assert abs(out.logprob - float(row[out.token_id])) < 1e-4
