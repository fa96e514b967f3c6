"""Helpers for architecture tests: save a tiny random transformers model as a model dir, run
greedy requests through the engine, and get transformers' own greedy tokens to compare."""

from __future__ import annotations

from pathlib import Path

import torch

from model_worker.engine import LLMEngine
from model_worker.model_runner import ModelRunner
from model_worker.sequence import SamplingParams

# Different lengths, one longer than the step budgets the tests use, so prefill chunks run
# next to decodes of the shorter prompts.
PROMPTS = [list(range(3, 40)), [7, 8], [9, 10, 11, 12], [500, 1200, 33, 4000, 17, 2]]


def save_tiny_model(model, out: Path, tokenizer_dir: Path) -> Path:
    """model.save_pretrained (safetensors) into out, with tokenizer_dir's tokenizer files."""
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def engine_greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, step_budget: int,
                  **params) -> dict[int, list]:
    """Greedy outputs (SequenceOutput lists, by prompt index) with logprobs, no stop tokens."""
    engine = LLMEngine(runner, [], max_num_seqs=8, max_num_batched_tokens=step_budget, max_waiting_requests=16)
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, SamplingParams(logprobs=True, **params), max_tokens=max_tokens,
                           stop_token_ids=[], ignore_eos=True)
    outputs: dict[int, list] = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        for out in engine.step():
            outputs[out.seq_id].append(out)
    return outputs


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy generate, never stopping early."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_matches_transformers(runner: ModelRunner, model) -> None:
    """Every prompt of PROMPTS through the engine in ragged steps (a 7-token budget pushes the
    37-token prompt through 6 chunks beside the others' decodes): the same greedy tokens as
    transformers' generate, and each token's logprob within 1e-4 of transformers' own."""
    outputs = engine_greedy(runner, PROMPTS, max_tokens=8, step_budget=7)
    for i, prompt in enumerate(PROMPTS):
        tokens = [o.token_id for o in outputs[i]]
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens[:-1]])).logits[0].log_softmax(-1)  # [len - 1, V]
        for j, out in enumerate(outputs[i]):
            row = ref[len(prompt) - 1 + j]
            assert out.token_id == int(row.argmax())
            assert abs(out.logprob - float(row[out.token_id])) < 1e-4
        assert tokens == hf_greedy(model, prompt, 8)


def assert_prompt_logprobs_match_transformers(runner: ModelRunner, model) -> None:
    """The first prompt's prompt logprobs within 1e-4 of transformers' log-softmax."""
    prompt = PROMPTS[0]
    out = engine_greedy(runner, [prompt], max_tokens=1, step_budget=10, prompt_logprobs=0)[0][0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [n, V]
    expected = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    got = out.prompt_logprobs.logprobs[1:]
    assert len(got) == len(expected)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4


def perturb_weights(model, seed: int = 0, std: float = 0.05) -> None:
    """Noise on every weight, beyond transformers' small init (and norms off 1), so every
    weight moves the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * std)


def max_logprob_error(runner: ModelRunner, model) -> float:
    """The largest |logprob - transformers' logprob| over the tokens the engine picks for
    PROMPTS in the same ragged steps as assert_greedy_matches_transformers (transformers run
    teacher-forced on those tokens): the figure that shows a variant changes the outputs."""
    outputs = engine_greedy(runner, PROMPTS, max_tokens=8, step_budget=7)
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        tokens = [o.token_id for o in outputs[i]]
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens[:-1]])).logits[0].log_softmax(-1)  # [len - 1, V]
        for j, out in enumerate(outputs[i]):
            worst = max(worst, abs(out.logprob - float(ref[len(prompt) - 1 + j, out.token_id])))
    return worst
