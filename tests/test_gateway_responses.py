"""Unit tests of the response side: chunk and completion shapes, logprob rendering, SSE framing.

Shapes are checked by parsing them with the official openai SDK's own response types.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai.types as oai
import openai.types.chat as oai_chat
import pytest

from gateway.errors import APIError, error_sse_event
from gateway.request_state import GenerationEvent
from gateway.responses import (
    SSE_DONE,
    ChatResponder,
    ChoiceEvents,
    ChoiceOutput,
    CompletionResponder,
    PromptEcho,
    UsageCounts,
    sse_event,
    sse_stream,
    usage,
)


class ByteSpeller:
    """Token id i spells the single byte i, the way a byte-level vocabulary's first entries do."""

    renders_in_stream = False

    async def ensure(self, token_ids: object) -> None:
        return None

    def absorb(self, token_ids: object, rendered: object) -> None:
        return None

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


PROMPT = PromptEcho("hi", [104, 105])


def event(text: str, ids: list[int], finish: str | None = None, logprobs: bool = False,
          total: int | None = None) -> GenerationEvent:
    return GenerationEvent(text=text, token_ids=ids, logprobs=[-0.5] * len(ids) if logprobs else [],
                           top_logprobs=[[(i, -0.5), (65, -1.0)] for i in ids] if logprobs else [],
                           finish_reason=finish, num_prompt_tokens=3,
                           num_output_tokens=len(ids) if total is None else total)


def as_json(model: object) -> dict:
    return json.loads(sse_event(model).removeprefix("data: "))  # type: ignore[arg-type]


def test_sse_framing() -> None:
    assert sse_event({"a": 1}) == 'data: {"a": 1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def test_sse_lines_survive_splitlines_readers() -> None:
    """Model text with U+0085 / U+2028 / U+2029 (JSON leaves them raw) must not end the data
    line for clients that split with str.splitlines, as httpx's aiter_lines does (a soak client
    read half an event); escaped, the JSON decodes to the same text."""
    from pydantic import BaseModel

    class Text(BaseModel):
        text: str

    text = "a\u2028b\x85c\u2029d\ne\u00e9\x1c"
    framed = {"pydantic": sse_event(Text(text=text)), "dict": sse_event({"text": text}),
              "error": error_sse_event(APIError(400, text))}
    for kind, event_text in framed.items():
        # splitlines sees exactly the data line and the blank line that ends the event
        assert event_text.splitlines() == [event_text[:-2], ""], (kind, event_text)
        body = json.loads(event_text.removeprefix("data: "))
        assert (body["error"]["message"] if kind == "error" else body["text"]) == text
    assert sse_event({"text": "plain"}) == 'data: {"text": "plain"}\n\n'  # ASCII passes as is


def test_chat_stream_chunks() -> None:
    responder = ChatResponder("m", ByteSpeller(), logprobs=False, include_usage=True)
    (first,) = responder.first_chunks(1)
    body = as_json(first)
    assert body["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert body["object"] == "chat.completion.chunk" and body["id"].startswith("chatcmpl-")
    middle = as_json(responder.chunk(0, event("hi", [104, 105])))
    assert middle["choices"][0]["delta"] == {"content": "hi"} and middle["choices"][0]["finish_reason"] is None
    last = as_json(responder.chunk(0, event("", [], finish="length")))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    tail = as_json(responder.usage_chunk(usage(3, 2, 1)))
    assert tail["choices"] == [] and tail["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                                       "prompt_tokens_details": {"cached_tokens": 1, "audio_tokens": 0}}
    for chunk in (body, middle, last, tail):
        oai_chat.ChatCompletionChunk.model_validate(chunk)
    assert len({c["id"] for c in (body, middle, last, tail)}) == 1


def test_chat_response_with_logprobs_parses_as_openai() -> None:
    responder = ChatResponder("m", ByteSpeller(), logprobs=True)
    out = ChoiceOutput()
    out.add(event("AB", [65, 66], logprobs=True))
    out.add(event("", [], finish="stop", total=2))
    body = responder.response([out], num_prompt_tokens=3).model_dump()
    parsed = oai_chat.ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.choices[0].message.content == "AB"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None and parsed.usage.total_tokens == 5
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["A", "B"] and content[0]["bytes"] == [65]
    assert content[1]["top_logprobs"][0] == {"token": "B", "logprob": -0.5, "bytes": [66]}


def test_chat_response_without_logprobs_has_null_logprobs() -> None:
    out = ChoiceOutput()
    out.add(event("x", [120], finish="stop"))
    body = ChatResponder("m", ByteSpeller(), logprobs=False).response([out], 3).model_dump()
    assert body["choices"][0]["logprobs"] is None and body["system_fingerprint"]


def test_completion_response_and_stream_logprobs() -> None:
    responder = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[PROMPT], n=2)
    outputs = [ChoiceOutput(), ChoiceOutput()]
    outputs[0].add(event("AB", [65, 66], finish="length", logprobs=True))
    outputs[1].add(event("C", [67], finish="stop", logprobs=True))
    body = responder.response(outputs, num_prompt_tokens=3).model_dump()
    parsed = oai.Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.usage is not None and parsed.usage.completion_tokens == 3 and parsed.usage.prompt_tokens == 3
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["A", "B"] and logprobs["text_offset"] == [0, 1]
    # the chosen token is listed among the alternatives, as OpenAI's legacy shape does
    assert logprobs["top_logprobs"][1] == {"B": -0.5, "A": -1.0}

    streaming = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[PROMPT], n=1)
    first = as_json(streaming.chunk(0, event("AB", [65, 66], logprobs=True)))
    second = as_json(streaming.chunk(0, event("C", [67], finish="stop", logprobs=True)))
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]  # offsets continue across chunks
    assert first["choices"][0]["finish_reason"] is None  # the SDK reads stream chunks without validating
    oai.Completion.model_validate(second)


async def events_then(items: list[tuple[int, GenerationEvent] | APIError]) -> ChoiceEvents:
    for item in items:
        if isinstance(item, APIError):
            raise item
        yield item


async def collect(stream: AsyncIterator[str]) -> list[str]:
    return [part async for part in stream]


async def test_sse_stream_chat_with_usage() -> None:
    responder = ChatResponder("m", ByteSpeller(), logprobs=False, include_usage=True)
    first = (0, event("a", [97]))
    rest = events_then([(0, event("b", [98], finish="stop", total=2))])
    parts = await collect(sse_stream(first, rest, responder, 3, [3] * 1))
    assert parts[-1] == SSE_DONE and all(p.startswith("data: ") and p.endswith("\n\n") for p in parts)
    bodies = [json.loads(p.removeprefix("data: ")) for p in parts[:-1]]
    assert [b["choices"][0]["delta"] for b in bodies[:3]] == [{"role": "assistant", "content": ""},
                                                               {"content": "a"}, {"content": "b"}]
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 2


async def test_sse_stream_failure_after_start_is_an_error_event_then_done() -> None:
    responder = CompletionResponder("m", ByteSpeller(), logprobs=False, prompts=[PROMPT], include_usage=True)
    rest = events_then([APIError(503, "lost the detok worker stream")])
    parts = await collect(sse_stream((0, event("a", [97])), rest, responder, 3, [3] * 1))
    assert parts[-1] == SSE_DONE
    error = json.loads(parts[-2].removeprefix("data: "))
    assert error == {"error": {"message": "lost the detok worker stream", "type": "service_unavailable_error",
                               "param": None, "code": None}}
    assert json.loads(parts[0].removeprefix("data: "))["choices"][0]["text"] == "a"


async def test_sse_stream_interleaves_choices_and_counts_usage_over_all() -> None:
    responder = CompletionResponder("m", ByteSpeller(), logprobs=False, prompts=[PROMPT], n=2, include_usage=True)
    rest = events_then([(1, event("b", [98])), (0, event("c", [99], finish="stop", total=2)),
                        (1, event("d", [100], finish="length", total=2))])
    parts = await collect(sse_stream((0, event("a", [97])), rest, responder, 3, [3] * 2))
    bodies = [json.loads(p.removeprefix("data: ")) for p in parts[:-1]]
    assert [(b["choices"][0]["index"], b["choices"][0]["text"]) for b in bodies[:-1]] == [
        (0, "a"), (1, "b"), (0, "c"), (1, "d")]
    assert all(b["usage"] is None for b in bodies[:-1])
    assert bodies[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0}}


async def test_sse_stream_without_include_usage_has_no_usage_key() -> None:
    responder = ChatResponder("m", ByteSpeller(), logprobs=False, include_usage=False)
    rest = events_then([(0, event("b", [98], finish="stop"))])
    parts = await collect(sse_stream((0, event("a", [97])), rest, responder, 3, [3] * 1))
    bodies = [json.loads(p.removeprefix("data: ")) for p in parts[:-1]]
    assert bodies and all("usage" not in b for b in bodies) and parts[-1] == SSE_DONE


def test_echo_streams_the_prompt_once_per_choice() -> None:
    responder = CompletionResponder("m", ByteSpeller(), logprobs=False, prompts=[PROMPT], n=2, echo=True)
    texts = [as_json(responder.chunk(i, event(t, [ord(t)])))["choices"][0]["text"]
             for i, t in [(0, "a"), (1, "b"), (0, "c")]]
    assert texts == ["hia", "hib", "c"]


def test_cached_prompt_tokens_count_each_prompt_once() -> None:
    """Two prompts, n=2: the two choices of a prompt share its prefill and both report its cached
    tokens, which usage counts once per prompt (16 + 32), not once per choice."""
    responder = CompletionResponder("m", ByteSpeller(), logprobs=False, prompts=[PROMPT, PROMPT], n=2)
    outputs = []
    for num_cached in (16, 16, 32, 32):
        out = ChoiceOutput()
        finished = event("a", [97], finish="stop")
        finished.num_cached_prompt_tokens = num_cached
        out.add(finished)
        outputs.append(out)
    body = responder.response(outputs, num_prompt_tokens=80).model_dump()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 48, "audio_tokens": 0}
    assert ChatResponder("m", ByteSpeller(), logprobs=False).num_cached_prompt_tokens([16, 16, 16]) == 16


TEXTS = ["", "hello", ' "quoted" \\ back', "é ü 日本 🙂", "line\nbreak\ttab", "\x00\x1f\x7f", "\u2028\u2029\x85"]


def test_plain_stream_chunks_are_the_models_json_exactly() -> None:
    """stream_chunk_json joins text-only chunks by hand: the same JSON, byte for byte, as the
    pydantic models give, with and without usage; other chunks go through the models."""
    def pair(make):
        return make(), make()

    cases = [(text, finish) for text in TEXTS for finish in (None, "stop", "length")]
    for with_usage in (False, True):
        for total in (None, UsageCounts(3, 7, 2)):
            if total is not None and not with_usage:
                continue
            for text, finish in cases:
                for fast, slow in (pair(lambda: ChatResponder("m\u00e9", ByteSpeller(), False)),
                                   pair(lambda: CompletionResponder("m", ByteSpeller(), False, [PROMPT], n=2))):
                    slow.id, slow.created = fast.id, fast.created
                    ev = event(text, [120], finish)
                    assert fast._plain_choice_json(1, ev) is not None
                    reference = slow.chunk(1, ev)
                    reference.usage = total.model() if total is not None else None
                    want = reference.model_dump_json(exclude=None if with_usage else {"usage"})
                    assert fast.stream_chunk_json(1, ev, total, with_usage) == want


@pytest.mark.parametrize("counts", [(0, 0, 0), (3, 7, 2), (123456, 654321, 99999)])
def test_usage_counts_json_is_the_models_json_exactly(counts) -> None:
    assert UsageCounts(*counts).json() == usage(*counts).model_dump_json()
    assert UsageCounts(*counts).model() == usage(*counts)


def test_chunks_with_logprobs_or_echo_go_through_the_models() -> None:
    with_logprobs = CompletionResponder("m", ByteSpeller(), True, [PROMPT])
    echoing = CompletionResponder("m", ByteSpeller(), False, [PROMPT], echo=True)
    chat_logprobs = ChatResponder("m", ByteSpeller(), True)
    ev = event("a", [97], logprobs=True)
    for responder in (with_logprobs, echoing, chat_logprobs):
        assert responder._plain_choice_json(0, ev) is None
    assert json.loads(echoing.stream_chunk_json(0, ev))["choices"][0]["text"] == "hia"  # echo, then the text
    assert json.loads(echoing.stream_chunk_json(0, ev))["choices"][0]["text"] == "a"  # echoed once
    lp = json.loads(with_logprobs.stream_chunk_json(0, ev))["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a"] and lp["token_logprobs"] == [-0.5]


def test_text_offset_counts_characters_of_the_text_not_byte_labels() -> None:
    # "é" (C3 A9) as two byte tokens, then "x", then "日" (E6 97 A5) split over two chunks.
    responder = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[PROMPT], n=1)
    first = as_json(responder.chunk(0, event("éx", [0xC3, 0xA9, 0x78, 0xE6], logprobs=True)))
    logprobs = first["choices"][0]["logprobs"]
    assert logprobs["text_offset"] == [0, 0, 1, 2]  # the character starts where its first byte does
    second = as_json(responder.chunk(0, event("日!", [0x97, 0xA5, 0x21], finish="stop", logprobs=True)))
    assert second["choices"][0]["logprobs"]["text_offset"] == [2, 2, 3]  # "!" is character 3 of "éx日!"


def test_text_offset_after_an_echoed_prompt_that_ends_inside_a_character() -> None:
    # The prompt's ids end with F0 9F (half an emoji): its echo ends in U+FFFD, and the output's
    # 98 80 do not finish the character (the detok worker starts afresh): two more U+FFFD. "a" is
    # character 9 of the text, not 7.
    prompt = PromptEcho("Emoji:\ufffd", [*b"Emoji:", 0xF0, 0x9F])
    responder = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[prompt], n=1, echo=True)
    choice = as_json(responder.chunk(0, event("\ufffd\ufffda", [0x98, 0x80, 0x61], finish="length",
                                              logprobs=True)))["choices"][0]
    assert choice["text"] == "Emoji:\ufffd\ufffd\ufffda"
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9]
    assert choice["text"][9] == "a"


def test_text_offset_skips_the_special_tokens_the_text_leaves_out() -> None:
    # skip_special_tokens: token 1 is in the logprobs but not in the text; "B" is character 1.
    responder = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[PROMPT], n=1,
                                    skipped_ids=frozenset({1}))
    choice = as_json(responder.chunk(0, event("AB", [0x41, 1, 0x42], finish="length", logprobs=True)))["choices"][0]
    assert choice["logprobs"]["text_offset"] == [0, 1, 1]
    # An echoed text prompt is the text as sent: a BOS the tokenizer added (token 2 here, not in
    # the text) moves no offset ("Hello world" read [0, 12, 17] with Llama's "<s>"), while a
    # special token the prompt wrote itself does.
    bos = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[PromptEcho("hi", [2, 104, 105])], n=1,
                              echo=True, special_ids=frozenset({2}))
    choice = as_json(bos.chunk(0, event("A", [0x41], finish="length", logprobs=True)))["choices"][0]
    assert choice["text"] == "hiA" and choice["logprobs"]["text_offset"] == [0, 0, 1, 2]
    # The echoed prompt keeps its special tokens: it is the prompt's own text.
    echoing = CompletionResponder("m", ByteSpeller(), logprobs=True, prompts=[PromptEcho("\x01h", [1, 104])], n=1,
                                  echo=True, skipped_ids=frozenset({1}), special_ids=frozenset({1}))
    choice = as_json(echoing.chunk(0, event("A", [0x41], finish="length", logprobs=True)))["choices"][0]
    assert choice["text"] == "\x01hA" and choice["logprobs"]["text_offset"] == [0, 1, 2]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_reasoning_is_split_off_the_same_streamed_and_whole(parser: str) -> None:
    from gateway.responses import ToolCallMode

    text = '<think>\nweigh it\n</think>\n\nSure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]  # tags cut across events
    events = [(0, event(p, [ord(p[0])], finish="stop" if i == len(pieces) - 1 else None))
              for i, p in enumerate(pieces)]

    def responder() -> ChatResponder:
        return ChatResponder("m", ByteSpeller(), logprobs=False, tool_calls=ToolCallMode(parser="hermes"),
                             reasoning_parser=parser)

    out = ChoiceOutput()
    for _, e in events:
        out.add(e)
    message = responder().response([out], 3).model_dump()["choices"][0]
    assert message["message"]["reasoning"] == message["message"]["reasoning_content"] == "\nweigh it\n"
    assert message["message"]["content"] == "Sure." and message["finish_reason"] == "tool_calls"
    assert message["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}

    parts = await collect(sse_stream(events[0], events_then(events[1:]), responder(), 3, [3] * 1))
    deltas = [c["choices"][0]["delta"] for c in (json.loads(p[6:]) for p in parts if p.startswith("data: {"))]
    assert all(deltas), deltas  # no empty chunks while a tag is held back
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nweigh it\n"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    assert not any(d.get("content") for d in deltas if d.get("reasoning"))
    [call] = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert call["function"]["name"] == "f"
    for part in parts[:-1]:
        oai_chat.ChatCompletionChunk.model_validate(json.loads(part[6:]))


def test_without_a_reasoning_parser_the_message_has_no_reasoning_keys() -> None:
    out = ChoiceOutput()
    out.add(event("<think>x</think>y", [1], finish="stop"))
    plain = ChatResponder("m", ByteSpeller(), logprobs=False).response([out], 3).model_dump()["choices"][0]["message"]
    assert plain["content"] == "<think>x</think>y" and "reasoning" not in plain and "reasoning_content" not in plain
    only_thinking = ChoiceOutput()
    only_thinking.add(event("still thinking", [1], finish="length"))
    r1 = ChatResponder("m", ByteSpeller(), logprobs=False, reasoning_parser="deepseek_r1")
    message = r1.response([only_thinking], 3).model_dump()["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] == "still thinking"


def test_a_required_call_list_the_response_cannot_encode_is_not_a_call_list() -> None:
    from gateway.responses import ToolCallMode

    required = ToolCallMode()
    assert required.calls('[{"name": "f", "parameters": {"a": "\\ud800"}}]') is None  # a lone surrogate
    (call,) = required.calls('[{"name": "f", "parameters": {"a": "\\ud83d\\ude00"}}]')
    assert (call.function.name, call.function.arguments) == ("f", '{"a": "\U0001f600"}')


async def test_a_named_call_with_no_text_after_the_thinking_is_no_call() -> None:
    # The output stopped while thinking: no call with empty arguments, streamed or whole.
    from gateway.responses import ToolCallMode

    def responder() -> ChatResponder:
        return ChatResponder("m", ByteSpeller(), logprobs=False, tool_calls=ToolCallMode("pick"),
                             reasoning_parser="deepseek_r1", constrained=True)

    events = [(0, event("still ", [1])), (0, event("thinking", [2], finish="stop"))]
    out = ChoiceOutput()
    for _, e in events:
        out.add(e)
    message = responder().response([out], 3).model_dump()["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"] is None and message["reasoning"] == "still thinking"
    parts = await collect(sse_stream(events[0], events_then(events[1:]), responder(), 3, [3] * 1))
    deltas = [c["choices"][0]["delta"] for c in (json.loads(p[6:]) for p in parts if p.startswith("data: {"))]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == "still thinking"
    # Once the answer starts, the call opens with it.
    answered = responder()
    assert answered.chunk(0, event("x</think>", [1])) is not None
    opened = as_json(answered.chunk(0, event('{"a": 1}', [2], finish="stop")))
    call = opened["choices"][0]["delta"]["tool_calls"][0]
    assert call["function"] == {"name": "pick", "arguments": '{"a": 1}'} and opened["choices"][0]["finish_reason"] == "stop"


async def test_with_a_deferred_grammar_the_thinking_ends_at_its_token_not_at_a_spelled_tag() -> None:
    # The model worker starts the grammar after token 15 ("</think>"); a "</think>" spelled in
    # other tokens before it is still thinking, streamed and whole alike.
    def responder() -> ChatResponder:
        return ChatResponder("m", ByteSpeller(), logprobs=False, reasoning_parser="deepseek_r1", constrained=True,
                             think_end_id=15)

    events = [(0, event("a </think> b", [1, 2, 3])), (0, event("</think>", [15])), (0, event(" no", [4], finish="stop"))]
    out = ChoiceOutput()
    for _, e in events:
        out.add(e)
    message = responder().response([out], 3).model_dump()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("a </think> b", " no")
    parts = await collect(sse_stream(events[0], events_then(events[1:]), responder(), 3, [3] * 1))
    deltas = [c["choices"][0]["delta"] for c in (json.loads(p[6:]) for p in parts if p.startswith("data: {"))]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "a </think> b"
    assert "".join(d.get("content") or "" for d in deltas) == " no"
    # Without a deferred grammar the text decides, as vLLM's parsers do.
    free = ChatResponder("m", ByteSpeller(), logprobs=False, reasoning_parser="deepseek_r1")
    assert free.response([out], 3).model_dump()["choices"][0]["message"]["content"] == "b</think> no"


async def test_a_spelled_tag_in_the_event_that_brings_the_thinking_end_token_is_still_thinking() -> None:
    # The detok worker may hand the spelled tag and token 15 over in one event (text held back for
    # a stop string); the thinking ends at the event's last "</think>", and a forced call's
    # arguments are the JSON after it, streamed and whole alike.
    from gateway.responses import ToolCallMode

    def responder() -> ChatResponder:
        return ChatResponder("m", ByteSpeller(), logprobs=False, reasoning_parser="deepseek_r1", constrained=True,
                             think_end_id=15, tool_calls=ToolCallMode("pick"))

    events = [(0, event("a </think> b</think>", [1, 2, 3, 15])), (0, event('{"a": 1}', [4], finish="stop"))]
    out = ChoiceOutput()
    for _, e in events:
        out.add(e)
    message = responder().response([out], 3).model_dump()["choices"][0]["message"]
    assert message["reasoning"] == "a </think> b"
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a": 1}']
    parts = await collect(sse_stream(events[0], events_then(events[1:]), responder(), 3, [3] * 1))
    deltas = [c["choices"][0]["delta"] for c in (json.loads(p[6:]) for p in parts if p.startswith("data: {"))]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "a </think> b"
    arguments = [call["function"]["arguments"] for d in deltas for call in d.get("tool_calls") or []]
    assert "".join(arguments) == '{"a": 1}'
    # The answer spells the tag after the real token in the same event: the thinking still ends
    # at the token's (the renderer knows the ids after it: their text holds one tag).
    spelled_after = ChatResponder("m", ByteSpeller(), logprobs=False, reasoning_parser="deepseek_r1",
                                  constrained=True, think_end_id=15)
    tail = list(b"x</think>")
    chunk = as_json(spelled_after.chunk(0, event("a </think> b</think>x</think>", [1, 2, 3, 15, *tail],
                                                 finish="stop")))
    delta = chunk["choices"][0]["delta"]
    assert (delta["reasoning"], delta["content"]) == ("a </think> b", "x</think>")
    # The answer starts in the same event: the text after the token's tag is the call's.
    same_event = responder()
    chunk = as_json(same_event.chunk(0, event('a </think> b</think>{"a"', [1, 2, 3, 15, 4])))
    assert chunk["choices"][0]["delta"]["reasoning"] == "a </think> b"
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"a"'
