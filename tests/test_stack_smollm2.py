"""The whole stack on the real SmolLM2-135M-Instruct: three processes on loopback, driven by
the official openai client, with greedy outputs checked against transformers generate.
"""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from tokenwire.grpc_server import CHANNEL_OPTIONS
from tokenwire.packing import unpack_int32_list
from tokenwire.stack import start_stack
from tokenwire.v1 import model_worker_pb2 as pb
from tokenwire.v1 import model_worker_pb2_grpc

pytestmark = pytest.mark.slow

PARITY_PROMPTS = [
    "Write a short poem about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Explain how a bicycle works to a child.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    # float32: the greedy parity below compares token ids with transformers' float32 generate;
    # the bf16 default is checked against the same answers in test_model_runner_bf16.
    with start_stack(["--model", "default", "--dtype", "float32", "--max-num-seqs", "8",
                      "--max-model-len", "1024"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return tokenizer, model


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def hf_greedy(hf, prompt_ids: list[int]) -> list[int]:
    tokenizer, model = hf
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_capital_of_france_is_paris_and_stream_matches_non_stream(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                           max_tokens=40)
    content = reply.choices[0].message.content
    assert "Paris" in content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 20
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                            max_tokens=40, stream=True)
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(deltas) == content
    assert finish == "stop"


def test_greedy_token_ids_equal_transformers_generate(stack, hf):
    """Token ids straight from the model worker's gRPC stream (token-in/token-out)."""
    tokenizer, _ = hf
    prompts = [chat_ids(tokenizer, p) for p in PARITY_PROMPTS]
    adds = [pb.AddRequest(request_id=str(i), prompt_token_ids=ids, max_tokens=NEW_TOKENS)
            for i, ids in enumerate(prompts)]
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    with grpc.insecure_channel(stack.model_worker_address, options=CHANNEL_OPTIONS) as channel:
        for frame in model_worker_pb2_grpc.ModelWorkerStub(channel).Generate(iter([pb.RequestFrame(adds=adds)]),
                                                                             timeout=300):
            for seq in frame.sequences:
                assert seq.finish_reason != pb.FINISH_REASON_ERROR, seq.error.message
                got[seq.request_id] += unpack_int32_list(seq.token_ids)
    for i, ids in enumerate(prompts):
        expected = hf_greedy(hf, ids)
        assert got[str(i)] == expected, f"prompt {i}: {tokenizer.decode(got[str(i)])!r} != {tokenizer.decode(expected)!r}"
    assert any(len(got[k]) == NEW_TOKENS for k in got), "no prompt ran the full 64 tokens"


def test_greedy_text_through_gateway_equals_transformers(client, hf):
    tokenizer, _ = hf
    for prompt in PARITY_PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        expected = tokenizer.decode(hf_greedy(hf, ids), skip_special_tokens=True)
        reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, temperature=0,
                                          max_tokens=NEW_TOKENS)
        assert reply.choices[0].text == expected
