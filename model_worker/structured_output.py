"""Structured output: compiles per-request constraints (JSON schema, JSON object, regex, GBNF/Lark
grammar, choice) with llguidance and turns each step's constrained rows into token bitmasks.

Sits between the request (AddRequest.structured_output -> Constraint) and the sampler: the
engine loop compiles off the hot path (GrammarCompiler, cached by constraint), each sequence
owns a GrammarMatcher, and each step fills one packed bitmask for its constrained rows only.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import llguidance
import llguidance.torch
import torch

from model_worker.sampling.processors import (  # noqa: F401  (their home; imported here by tests and bench)
    apply_token_bitmask_,
    unpack_bitmask,
    unpack_bitmask_torch,
)
from tokenwire.v1 import model_worker_pb2 as pb

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]

# llguidance's JSON options. Compact separators with the ", " / ": " spacing models see most:
# flexible whitespace would let a small model pad forever with newlines inside the object.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint the engine cannot compile; the message is safe to show the client."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint as data: the cache key of its compiled grammar."""

    kind: ConstraintKind
    # JSON Schema text, regex, grammar text, or a JSON list of choices; "" for json_object.
    text: str


def constraint_from_proto(structured_output: pb.StructuredOutput) -> Constraint | None:
    """tokenwire.v1.StructuredOutput -> Constraint, or None when the request has none."""
    kind = structured_output.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not structured_output.json_object):
        return None
    if kind == "json_object":
        return Constraint("json_object", "")
    if kind == "choice":
        return Constraint("choice", json.dumps(list(structured_output.choice.choices), ensure_ascii=False))
    return Constraint(kind, getattr(structured_output, kind))


# The characters llguidance's regex syntax (Rust's regex crate) gives a meaning: regex_syntax::escape's set.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def llguidance_grammar(constraint: Constraint) -> str:
    """Constraint -> llguidance's grammar text; raises GrammarError for input that is not even
    well-formed (the engine's own checks come later, when a matcher is built)."""
    kind, text = constraint.kind, constraint.text
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, not {json.dumps(schema)[:40]}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "grammar":
        if not text.strip():
            raise GrammarError("grammar is empty")
        try:
            # GBNF (llama.cpp, `root ::= ...`) or Lark (`start: ...`), detected from the text.
            return llguidance.grammar_from("grammar", text)
        except ValueError as exc:
            raise GrammarError(f"grammar: {exc}") from None
    if kind == "choice":
        choices = json.loads(text)
        if not isinstance(choices, list) or not choices:
            raise GrammarError("choice needs at least one string")
        if not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choices must be non-empty strings")
        # One regex of the literal choices: as Lark alternatives, llguidance's parser refused more
        # than 2000 of them, and only at the first token (review 88); a regex is one lexeme.
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(_regex_literal, choices)))
    raise GrammarError(f"unknown structured output kind {kind!r}")


class GrammarMatcher:
    """One sequence's position in its grammar: the tokens it may take next, and whether it is done."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar did not allow it."""
        return self._matcher.consume_token(token_id)

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (a forked sample of an n > 1 request)."""
        return GrammarMatcher(self._matcher.deep_copy())

    @property
    def is_finished(self) -> bool:
        """The output is complete: the grammar allows nothing more but the end (eos)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    @property
    def dead_end(self) -> bool:
        """Nothing the grammar allows can follow the output so far (its last mask, computed
        for this step, allowed only eos for that reason): an eos drawn now ends no document."""
        return self._matcher.is_error()


class CompiledGrammar:
    """A compiled constraint, shared by every request that uses it; hands out fresh matchers."""

    __slots__ = ("constraint", "_template")

    def __init__(self, constraint: Constraint, template: llguidance.LLMatcher) -> None:
        self.constraint = constraint
        # Never advanced: each sequence gets a copy, which is ~10 us against ~1 ms for a rebuild.
        self._template = template

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


# The most constraint text the cache keeps (besides the newest entry, whatever its size): a compiled
# grammar holds ~12 times its text (a 3 MiB choice list kept ~35 MiB), and 256 such entries grew a
# worker by ~9 GB where only the count was bounded (review 103).
MAX_CACHED_TEXT_CHARS = 16 << 20


class GrammarCompiler:
    """Compiles constraints on a small named thread pool and keeps the newest `cache_size`
    results, of at most max_cached_chars of constraint text between them (failures included, so
    a repeated bad schema is refused at once).

    The cache holds futures, so concurrent requests with one schema share one compilation.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, cache_size: int = 256, num_threads: int = 2,
                 max_cached_chars: int = MAX_CACHED_TEXT_CHARS) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self.max_cached_chars = max_cached_chars
        self._cache: OrderedDict[Constraint, Future[CompiledGrammar]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        # llguidance drops the GIL while it builds a grammar, so these threads do not slow steps.
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")

    @classmethod
    def from_tokenizer_file(cls, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int],
                            **kwargs) -> GrammarCompiler:
        """Builds llguidance's token trie from tokenizer.json (~1 s for a 49k vocabulary).

        vocab_size is the logits' width (may exceed the tokenizer's); eos_token_ids are the
        tokens a complete output may end with.
        """
        tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size,
                                           eos_token=list(eos_token_ids) or None)
        return cls(tokenizer, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def submit(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """Starts (or finds) the compilation; the future raises GrammarError on bad input."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = future
            self._cached_chars += len(constraint.text)
            while len(self._cache) > 1 and (len(self._cache) > self.cache_size
                                            or self._cached_chars > self.max_cached_chars):
                evicted, _ = self._cache.popitem(last=False)
                self._cached_chars -= len(evicted.text)
            return future

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Blocking form of submit(), for tests and benchmarks."""
        return self.submit(constraint).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        try:
            grammar = llguidance_grammar(constraint)
        except GrammarError:
            raise
        except (ValueError, RecursionError) as exc:  # llguidance's own refusals; JSON nested too deep
            raise GrammarError(f"cannot compile {constraint.kind}: {exc}") from None
        # llguidance reports bad grammars (unsupported JSON Schema keywords, bad regexes,
        # unsatisfiable bounds) as a matcher in the error state, never as an exception.
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"cannot compile {constraint.kind}: {template.get_error().strip()}")
        # A language with no text at all ([^\s\S]) shows only once a mask is computed: its first
        # mask allows only eos, which ended the output as a success with nothing in it (review 103).
        probe = template.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"cannot compile {constraint.kind}: no text matches it "
                               f"({probe.get_error().partition(chr(10))[0]})")
        return CompiledGrammar(constraint, template)


class TokenBitmaskFiller:
    """Fills one step's packed bitmask: the rows with a matcher, in parallel across rows."""

    def __init__(self, vocab_size: int, num_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor | None:
        """Row i's matcher (None: unconstrained) -> bitmask [S, ceil(V / 32)] int32 on the CPU, bit
        j of word w set when token 32 * w + j is allowed, unconstrained rows all ones (-1); None
        when no row is constrained, so a step without constraints costs nothing."""
        constrained = [(m._matcher, row) for row, m in enumerate(matchers) if m is not None]
        if not constrained:
            return None
        bitmask = torch.full((len(matchers), self.num_words), -1, dtype=torch.int32)
        # One call for every constrained row: llguidance computes the masks on its own threads.
        llguidance.torch.fill_next_token_bitmask_par(self._executor, constrained, bitmask)
        return bitmask


def allow_token_(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Sets token_id's bit in a row of a packed int32 bitmask [S, W], in place."""
    word = (int(bitmask[row, token_id // 32]) | (1 << (token_id % 32))) & 0xFFFFFFFF
    bitmask[row, token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as int32


