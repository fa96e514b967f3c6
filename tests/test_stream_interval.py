"""--stream-interval through the whole stack: a request's tokens reach the client in fewer, larger
SSE chunks (its first token alone, at once), and nothing about what it says changes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import openai_client, tiny_stack
from tokenwire.stack import Stack

pytestmark = pytest.mark.slow

INTERVAL = 4
MAX_TOKENS = 23
PROMPT = "Write a poem about the sea"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    with tiny_stack(tiny_model_dir, 256, "--stream-interval", str(INTERVAL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai_client(stack.gateway_url)


def test_streamed_tokens_come_in_groups_and_say_what_the_whole_answer_says(client: openai.OpenAI, model: str):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs))
    with_tokens = [c for c in chunks if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in with_tokens]
    assert sum(per_chunk) == MAX_TOKENS
    # Every step's token in a chunk of its own would be 23 chunks; held for 4 steps at a time
    # (the first alone), at most 1 + ceil(22 / 4). The running usage counts the same tokens.
    assert per_chunk[0] == 1
    assert len(per_chunk) <= 1 + math.ceil((MAX_TOKENS - 1) / INTERVAL)
    assert [c.usage.completion_tokens for c in with_tokens] == [sum(per_chunk[:i + 1]) for i in range(len(per_chunk))]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed_logprobs = [lp for c in with_tokens for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed_logprobs == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_a_stop_string_still_ends_the_text_where_it_matches(client: openai.OpenAI, model: str):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    # A stop string taken from the middle of the greedy answer, past the first token.
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    assert stop.strip() and text.index(stop) > 0
    whole = client.completions.create(stop=[stop], **kwargs).choices[0]
    streamed = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert whole.finish_reason == "stop" and whole.text == text[:text.index(stop)]
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "stop"
