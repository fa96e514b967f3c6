"""What the model dir's own files change in the API, on a stack over the tiny random model:
- a tokenizer that adds a BOS (Llama's, Mistral's): /v1/completions' add_special_tokens (vLLM's)
  leaves it out for a prompt that already holds one, as /tokenize does;
- generation_config.json's sampling fields: the defaults of a request that leaves them unset
  (vLLM's --generation-config auto);
- an embedding padded past the tokenizer's ids (Qwen2.5's 151936 rows for 151665 tokens): prompt
  ids past the tokenizer's are out of vocabulary, as in vLLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import tiny_stack

pytestmark = pytest.mark.slow

BOS = 1  # SmolLM2's <|im_start|>, made the BOS here
TOKENIZER_IDS = 49152  # SmolLM2's; the model's embedding here has 128 rows more


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory) -> str:
    from tokenizers import Tokenizer, processors

    model_dir = tmp_path_factory.mktemp("bos-model")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, model_dir / item.name)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B", special_tokens=[("<|im_start|>", BOS)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|im_start|>"}))
    config_json = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config_json, "vocab_size": TOKENIZER_IDS + 128}))
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0,
                                                                  "max_new_tokens": 5}))
    with tiny_stack(model_dir, 128) as stack:
        yield stack.gateway_url


def test_add_special_tokens_false_keeps_a_templated_prompts_one_bos(url: str) -> None:
    def prompt_tokens(prompt: str, **extra: object) -> int:
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 1, **extra})
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens"]

    def tokenize(prompt: str, **extra: object) -> list[int]:
        return httpx.post(f"{url}/tokenize", json={"prompt": prompt, **extra}, timeout=60).json()["tokens"]

    plain = tokenize("hello world", add_special_tokens=False)
    assert tokenize("hello world") == [BOS, *plain]
    assert prompt_tokens("hello world") == len(plain) + 1
    templated = "<|im_start|>hello world"  # a client's own rendering, its BOS already in
    assert tokenize(templated, add_special_tokens=False) == [BOS, *plain]
    assert prompt_tokens(templated, add_special_tokens=False) == len(plain) + 1
    assert prompt_tokens(templated) == len(plain) + 2  # the default adds one more, as vLLM's does


def test_a_request_leaving_sampling_unset_takes_generation_configs_values(url: str) -> None:
    def chat(**extra: object) -> dict:
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Write a poem"}], "ignore_eos": True, **extra})
        assert answer.status_code == 200, answer.text
        return answer.json()

    unset = [chat() for _ in range(2)]
    # temperature 0 from the file: greedy, the same every time (temperature 1 on this random
    # model's flat distribution would draw different tokens); max_new_tokens 5 bounds the length.
    assert unset[0]["choices"][0]["message"]["content"] == unset[1]["choices"][0]["message"]["content"]
    assert unset[0]["usage"]["completion_tokens"] == 5
    assert chat(max_tokens=50)["usage"]["completion_tokens"] == 5  # the least of the two, as vLLM
    assert chat(max_tokens=3)["usage"]["completion_tokens"] == 3
    drawn = {chat(temperature=1.0, seed=seed)["choices"][0]["message"]["content"] for seed in range(3)}
    assert len(drawn) > 1  # the request's own temperature wins


def test_the_models_default_output_length_is_cut_to_the_room_the_prompt_leaves(url: str) -> None:
    # generation_config.json's max_new_tokens (5) is no request: with 3 tokens of room left in the
    # context (128) it gives 3, as vLLM's; it asked for 130 tokens and got a 400 (review 97). The
    # body's own max_tokens is still refused past the context, as OpenAI's (completions' default, 16, too).
    def complete(prompt: list, **extra: object) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": prompt, "ignore_eos": True, **extra})

    answer = complete([28] * 125, max_tokens=None)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (125, 3, 128), usage
    answer = complete([[28] * 125, [28] * 10], max_tokens=None)  # each prompt its own room
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3 + 5
    for prompt_len, asked in ((125, {"max_tokens": 4}), (125, {}), (123, {"max_tokens": 100})):
        # 123 + 100: the body's 100 is checked, not the least of it and the default (5), as vLLM's
        refused = complete([28] * prompt_len, **asked)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded", refused.text
        assert f"{asked.get('max_tokens', 16)} in the completion" in refused.json()["error"]["message"], refused.text
    assert complete([28] * 123, max_tokens=5).json()["usage"]["completion_tokens"] == 5
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hello " * 94}], "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] > 123 and usage["prompt_tokens"] + usage["completion_tokens"] == 128, usage


def test_prompt_ids_past_the_tokenizers_are_out_of_vocabulary_though_the_embedding_has_them(url: str) -> None:
    # They generated (and echo failed in the detok worker; /detokenize dropped them): review 97.
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, timeout=60)

    for path, body, param in (("/v1/completions", {"prompt": [28120, TOKENIZER_IDS + 48], "max_tokens": 2}, "prompt"),
                              ("/detokenize", {"tokens": [28120, TOKENIZER_IDS]}, "tokens")):
        refused = post(path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert f"[0, {TOKENIZER_IDS})" in refused.json()["error"]["message"]
    assert post("/v1/completions", {"prompt": [28120, TOKENIZER_IDS - 1], "max_tokens": 2}).status_code == 200
    assert post("/detokenize", {"tokens": [28120, TOKENIZER_IDS - 1]}).status_code == 200
