"""A reasoning model's thinking, split from its answer (`--reasoning-parser`).

Models such as DeepSeek R1, QwQ and Qwen3 think between `<think>` and `</think>` before they answer.
The parser splits each chat output into `reasoning` (vLLM's field; `reasoning_content` too, its
older name that clients still read) and `content`, as it streams: feed() gives each delta's two
parts, finish() what was held back. The whole output is the same parser fed once, so a stream and
a non-stream answer split the same way. The rules (vLLM's parsers of the same names):
- deepseek_r1: the output starts inside the reasoning (R1's template opens `<think>` in the prompt;
  a `<think>` the model writes itself is dropped); everything up to `</think>` is reasoning, and an
  output that never closes it is all reasoning;
- qwen3: reasoning only where the output opens with `<think>` (Qwen3 with enable_thinking false, or a
  model that answers straight away, writes no tags: all content);
- the whitespace right after `</think>` is dropped (the template's line breaks before the answer).
The prompt's own tail (`prompt_tail`: the template's generation prompt, or the final message being
continued) comes first: where it opened `<think>` without closing it, the output starts in the
reasoning (a prefilled thought goes on); where it closed `</think>` (Qwen3's enable_thinking false
writes an empty block; an answer being continued), the output is all content.
Tool calls (tool_parsers) are looked for in the content only. A constraint on the output (structured
output, a forced call) applies to the answer: where the output starts in the thinking (or, for qwen3,
opens with `<think>`), the model worker starts it after the output's `</think>` token
(StructuredOutput.after_token_ids, opening_token_id), and the answer keeps its leading whitespace (it
is what the grammar matched).
"""

from __future__ import annotations

from gateway.tool_parsers import partial_tag_length

START = "<think>"
END = "</think>"


class ThinkStream:
    """One choice's output, delta by delta: (reasoning, content) of each."""

    starts_in_reasoning = True  # deepseek_r1; qwen3: only after an opening <think>

    def __init__(self, prompt_tail: str = "", keep_answer_space: bool = False) -> None:
        self._pending = ""  # text held back: a tag that may be starting
        self._state = "opening"  # opening (before the first non-space text), reasoning, answer_start, content
        # A constrained answer is exactly what its grammar matched: its leading whitespace stays.
        self._answer_start = "content" if keep_answer_space else "answer_start"
        start, end = prompt_tail.rfind(START), prompt_tail.rfind(END)
        if start > end:  # the prompt opened the thinking: a <think> the model writes again is dropped
            self.starts_in_reasoning = True
            if prompt_tail[start + len(START):].strip():
                self._state = "reasoning"  # a thought being continued
        elif end > start:  # the prompt closed it: what follows is the answer
            self._state = "content" if prompt_tail[end + len(END):].strip() else self._answer_start

    def feed(self, text: str, end_allowed: bool = True, brings_end_token: bool = False,
             ends_after_token: int = 0) -> tuple[str, str]:
        """end_allowed False: a END in this text is thinking too (the model worker, which starts
        a deferred grammar on END's token, has not seen that token yet: the model spelled the tag
        in other tokens). brings_end_token: this text carries END's token, so the thinking ends at
        the END that token wrote: the last but ends_after_token (the ENDs the answer spelled after
        the token in the same text); one spelled before the token is thinking too."""
        self._pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._pending:
            if self._state == "opening":
                stripped = self._pending.lstrip()
                if START.startswith(stripped):
                    break  # all space, or a <think> still being written
                if stripped.startswith(START):
                    self._pending = stripped[len(START):]
                    self._state = "reasoning"
                else:
                    self._state = "reasoning" if self.starts_in_reasoning else "content"
            elif self._state == "reasoning":
                if not end_allowed:
                    end = -1
                elif brings_end_token:
                    end = len(self._pending)
                    for _ in range(ends_after_token + 1):
                        end = self._pending.rfind(END, 0, end) if end > 0 else -1
                    if end < 0:  # fewer than counted: the token's own END is the first
                        end = self._pending.find(END)
                else:
                    end = self._pending.find(END)
                if end < 0:
                    held = partial_tag_length(self._pending, END) if end_allowed else 0
                    reasoning.append(self._pending[:len(self._pending) - held])
                    self._pending = self._pending[len(self._pending) - held:]
                    break
                reasoning.append(self._pending[:end])
                self._pending = self._pending[end + len(END):]
                self._state = self._answer_start
            elif self._state == "answer_start":
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = "content"
            else:
                content.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "reasoning" or (self._state == "opening" and self.starts_in_reasoning):
            return pending, ""
        if self._state == "answer_start":
            return "", ""
        return "", pending

    @property
    def starts_thinking(self) -> bool:
        """The output's start is read as thinking (before any of it is seen): deepseek_r1 unless
        the prompt closed the block; qwen3 only where the prompt opened one."""
        return self._state == "reasoning" or (self._state == "opening" and self.starts_in_reasoning)


class Qwen3ThinkStream(ThinkStream):
    starts_in_reasoning = False


REASONING_PARSERS: dict[str, type[ThinkStream]] = {"deepseek_r1": ThinkStream, "qwen3": Qwen3ThinkStream}


def how_output_starts(parser: str, prompt_tail: str) -> str:
    """Where a constraint on the answer (structured output, a forced call) can start (vLLM waits for
    END): "thinking", the output starts in the thinking (wait for END); "maybe", it is thinking only
    if it opens with START (qwen3 after a prompt without tags: a grammar from the first token would
    not let it write START, so the first token may be START or the grammar's); "answer", it starts
    in the answer (the prompt closed the thinking)."""
    stream = REASONING_PARSERS[parser](prompt_tail)
    if stream.starts_thinking:
        return "thinking"
    return "maybe" if stream._state == "opening" else "answer"


def split_reasoning(parser: str, text: str, prompt_tail: str = "", keep_answer_space: bool = False) -> tuple[str, str]:
    """A whole output's (reasoning, content): the stream parser fed once."""
    stream = REASONING_PARSERS[parser](prompt_tail, keep_answer_space)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content
