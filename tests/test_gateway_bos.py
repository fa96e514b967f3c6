"""A tokenizer that adds a BOS (Llama's, Mistral's): /v1/completions' add_special_tokens (vLLM's)
leaves it out for a prompt that already holds one, as /tokenize does. The stack runs the tiny
random model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import tiny_stack

pytestmark = pytest.mark.slow

BOS = 1  # SmolLM2's <|im_start|>, made the BOS here


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
    with tiny_stack(model_dir, 128) as stack:
        yield stack.gateway_url


def test_add_special_tokens_false_keeps_a_templated_prompts_one_bos(url: str) -> None:
    def prompt_tokens(prompt: str, **extra: object) -> int:
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
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
