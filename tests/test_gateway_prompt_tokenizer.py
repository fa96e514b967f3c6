"""Unit tests of PromptTokenizer with the real SmolLM2 tokenizer: prompt ids and token spellings.

The ids must be what transformers itself produces (greedy parity depends on it), and the
token bytes what the byte-level vocabulary really stands for.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.prompt_tokenizer import PromptTokenizer
from tokenwire.tokenizer_files import TokenizerMismatchError, tokenizer_identity


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PromptTokenizer:
    chat_template = (tiny_model_dir / "chat_template.jinja").read_text()
    return PromptTokenizer.load(tokenizer_identity(tiny_model_dir), chat_template)


def test_text_prompt_has_no_bos(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.encode_text("hello world") == [28120, 905]


def test_chat_prompt_ends_with_the_assistant_turn(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert all(isinstance(i, int) for i in ids)
    # <|im_start|>assistant\n closes the prompt (add_generation_prompt)
    assert ids[-3:] == tokenizer.encode_text("<|im_start|>assistant\n")[-3:]
    assert ids[0] == 1  # <|im_start|> of the default system turn


def test_token_bytes_are_exact(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.token_bytes(905) == b" world" and tokenizer.token_text(905) == " world"
    ids = tokenizer.encode_text("naïve 日本")
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == "naïve 日本".encode()
    assert tokenizer.token_bytes(2) == b"<|im_end|>"


async def test_long_prompts_are_encoded_off_the_event_loop(tokenizer: PromptTokenizer) -> None:
    """Same ids either way; a long text or conversation on a worker thread (the event loop streams
    other requests meanwhile), a short one inline (no thread hop on the common path)."""
    import threading

    from gateway.prompt_tokenizer import INLINE_ENCODE_MAX_CHARS

    threads: list[str] = []
    original = tokenizer.encode_text

    def spy(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return original(text, add_special_tokens)

    tokenizer.encode_text = spy  # type: ignore[method-assign]
    try:
        short, long = "hello world", "hello world " * (INLINE_ENCODE_MAX_CHARS // 12 + 1)
        assert await tokenizer.encode_text_async(short) == original(short)
        assert await tokenizer.encode_text_async(long) == original(long)
    finally:
        del tokenizer.encode_text
    assert threads[0] == threading.current_thread().name and threads[1] != threads[0], threads
    chat = [{"role": "user", "content": long}]
    assert await tokenizer.encode_chat_async(chat) == tokenizer.encode_chat(chat)


async def test_many_messages_without_content_are_templated_off_the_event_loop(tokenizer: PromptTokenizer) -> None:
    # Each renders its turn's markup whatever its content: counted by content alone, 450,000 empty
    # messages were templated inline (8.6 s with every stream stopped; review 97). Tool calls count too.
    import threading

    from gateway.prompt_tokenizer import INLINE_ENCODE_MAX_CHARS, MESSAGE_MARKUP_CHARS

    threads: list[str] = []
    original = tokenizer.encode_chat

    def spy(*args, **kwargs) -> list[int]:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    tokenizer.encode_chat = spy  # type: ignore[method-assign]
    many = INLINE_ENCODE_MAX_CHARS // MESSAGE_MARKUP_CHARS + 1
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": "y" * INLINE_ENCODE_MAX_CHARS}}}
    try:
        for chat in ([{"role": "user", "content": ""}], [{"role": "user", "content": ""}] * many,
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]):
            assert await tokenizer.encode_chat_async(chat) == original(chat)
    finally:
        del tokenizer.encode_chat
    me = threading.current_thread().name
    assert threads[0] == me and threads[1] != me and threads[2] != me, threads


def test_tokenizer_with_another_hash_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    identity = tokenizer_identity(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text() + "\n")
    with pytest.raises(TokenizerMismatchError):
        PromptTokenizer.load(identity)


def test_partial_character_tokens_render_as_escaped_bytes(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode_text("日本")
    partial = [i for i in ids if not _is_utf8(tokenizer.token_bytes(i))]
    assert partial, "expected a token that is part of a character"
    raw = tokenizer.token_bytes(partial[0])
    assert tokenizer.token_text(partial[0]) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_words_encode_without_special_tokens_and_decode_back(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.encode_words(" world") == [905]
    assert tokenizer.decode([28120, 905]) == "hello world"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_special_texts_are_what_skip_special_tokens_drops(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.add_tokens(["<tool_call>"], special_tokens=True)
    hf.add_tokens(["</tool_call>"], special_tokens=False)
    specials = PromptTokenizer(hf).special_texts()
    assert {"<|im_end|>", "<tool_call>"} <= specials and "</tool_call>" not in specials and " world" not in specials
    # What --tool-call-parser hermes keeps special tokens for: these vanish from the text otherwise.
    ids = hf.encode("<tool_call></tool_call>", add_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=True) == "</tool_call>"


def test_the_generation_prompt_is_what_add_generation_prompt_appends(tokenizer: PromptTokenizer,
                                                                      tiny_model_dir: Path) -> None:
    assert tokenizer.generation_prompt() == "<|im_start|>assistant\n"
    # Qwen3's shape: an empty thinking block when enable_thinking is false (the reasoning parser
    # then starts in the answer); a template that fails on one user message gives "".
    qwen3_like = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
    qwen3 = PromptTokenizer.load(tokenizer_identity(tiny_model_dir), qwen3_like)
    assert qwen3.generation_prompt({"enable_thinking": False}) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert qwen3.generation_prompt({"enable_thinking": True}) == "<|im_start|>assistant\n"
    strict = PromptTokenizer.load(tokenizer_identity(tiny_model_dir),
                                  "{{ raise_exception('two messages please') if messages|length < 2 }}")
    assert strict.generation_prompt() == ""


def test_documents_and_reasoning_effort_reach_the_template(tiny_model_dir: Path) -> None:
    # A retrieval template's shape (Command R's, Granite's read `documents`) and one that reads
    # reasoning_effort / enable_thinking, as vLLM passes them.
    template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}"
                "{% if enable_thinking is defined and not enable_thinking %}<no think>{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tokenizer = PromptTokenizer.load(tokenizer_identity(tiny_model_dir), template)
    messages = [{"role": "user", "content": "q"}]
    docs = [{"title": "Paris", "text": "capital of France"}]
    decode = tokenizer.decode
    assert decode(tokenizer.encode_chat(messages)) == "q"
    assert decode(tokenizer.encode_chat(messages, documents=docs)) == "[Paris: capital of France]q"
    kwargs = {"reasoning_effort": "none", "enable_thinking": False}
    assert decode(tokenizer.encode_chat(messages, template_kwargs=kwargs)) == "<effort none><no think>q"


def test_a_models_tool_use_template_renders_requests_that_send_tools(tiny_model_dir: Path, tmp_path: Path) -> None:
    # transformers saves named templates as additional_chat_templates/*.jinja beside
    # chat_template.jinja (Hermes, Command-R re-saved), and picks tool_use when tools are sent, as
    # vLLM does. The gateway passed the published default by name, so the model never saw the tools.
    from transformers import AutoTokenizer

    from model_worker.__main__ import chat_template_of

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.chat_template = {"default": "{% for m in messages %}DEFAULT {{ m['content'] }}\n{% endfor %}",
                        "tool_use": "{% for t in tools %}TOOL {{ t['function']['name'] }}\n{% endfor %}"
                                    "{% for m in messages %}TOOLS {{ m['content'] }}\n{% endfor %}"}
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    tokenizer = PromptTokenizer.load(tokenizer_identity(tmp_path), chat_template_of(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

    def rendered(**kwargs: object) -> str:
        return tokenizer.decode(tokenizer.encode_chat(messages, add_generation_prompt=False, **kwargs))

    assert rendered() == "DEFAULT hi\n"
    assert rendered(tools=tools) == "TOOL get_weather\nTOOLS hi\n"
    # A template the model worker publishes that is not the tokenizer's own is still the one used.
    other = PromptTokenizer.load(tokenizer_identity(tmp_path), "{% for m in messages %}OTHER {{ m['content'] }}{% endfor %}")
    assert other.decode(other.encode_chat(messages, add_generation_prompt=False, tools=tools)) == "OTHER hi"
