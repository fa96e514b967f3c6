"""The reasoning parsers (--reasoning-parser): whatever way the output is cut into deltas, the
stream splits thinking from answer as the whole text parsed once does."""

from __future__ import annotations

import pytest

from gateway.reasoning_parsers import REASONING_PARSERS, split_reasoning

CASES = {
    # text: (deepseek_r1's (reasoning, content), qwen3's)
    "<think>\nhmm, 2+2\n</think>\n\nIt is 4.": (("\nhmm, 2+2\n", "It is 4."), ("\nhmm, 2+2\n", "It is 4.")),
    # R1's template opens <think> in the prompt: the output starts inside it.
    "hmm\n</think>\n\nIt is 4.": (("hmm\n", "It is 4."), ("", "hmm\n</think>\n\nIt is 4.")),
    "no tags at all": (("no tags at all", ""), ("", "no tags at all")),
    "<think>never closed": (("never closed", ""), ("never closed", "")),
    "  <think>x</think>": (("x", ""), ("x", "")),
    "<thi": (("<thi", ""), ("", "<thi")),
    "<think>a</thin": (("a</thin", ""), ("a</thin", "")),
    "<think></think>answer</think>more": (("", "answer</think>more"), ("", "answer</think>more")),
    "\n\n": (("\n\n", ""), ("", "\n\n")),
}


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", list(CASES))
def test_every_way_of_cutting_the_stream_splits_the_same(parser: str, text: str) -> None:
    expected = CASES[text][0 if parser == "deepseek_r1" else 1]
    assert split_reasoning(parser, text) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            stream = REASONING_PARSERS[parser]()
            reasoning, content = [], []
            for piece in (text[:i], text[i:j], text[j:]):
                r, c = stream.feed(piece)
                reasoning.append(r)
                content.append(c)
            r, c = stream.finish()
            assert ("".join(reasoning) + r, "".join(content) + c) == expected, (i, j)


def test_thinking_streams_as_it_comes_and_a_tag_start_is_held() -> None:
    stream = REASONING_PARSERS["qwen3"]()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>let me see </th") == ("let me see ", "")
    assert stream.feed("ink>\n\n") == ("", "")
    assert stream.feed("Four.") == ("", "Four.")
    assert stream.finish() == ("", "")
