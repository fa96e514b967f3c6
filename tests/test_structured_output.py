"""Structured output with the real SmolLM2 tokenizer and a fake model: every sampled output obeys
its constraint, bad constraints are refused with a clear message, masks touch only their rows.

The fake model is random logits plus a fixed preference for JSON punctuation, drawn at
temperature 1.0; the grammar masks alone decide validity, the preference only keeps outputs short.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from model_worker.structured_output import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    TokenBitmaskFiller,
    apply_token_bitmask_,
    constraint_from_proto,
    unpack_bitmask,
    unpack_bitmask_torch,
)
from tokenwire.v1 import model_worker_pb2 as pb

EOS = 2  # SmolLM2's <|im_end|>
SEEDS = (0, 1, 2, 3)
OUTPUTS_PER_SEED = 25  # 100 outputs per constraint
MAX_STEPS = 160

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "status": {"enum": ["pending", "shipped", "delivered"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["sku", "qty"], "additionalProperties": False}},
        },
        "required": ["id", "status", "items"], "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "temp_c": {"type": "number", "minimum": -50, "maximum": 60},
                       "raining": {"type": "boolean"},
                       "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["city", "temp_c", "raining"], "additionalProperties": False,
    },
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    "shape": {
        "$defs": {
            "circle": {"type": "object", "properties": {"kind": {"const": "circle"},
                                                        "r": {"type": "number", "exclusiveMinimum": 0}},
                       "required": ["kind", "r"], "additionalProperties": False},
            "rect": {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "integer"},
                                                      "h": {"type": "integer"}},
                     "required": ["kind", "w", "h"], "additionalProperties": False},
        },
        "anyOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/rect"}],
    },
}
EMAIL_REGEX = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org|net)"
CHOICES = ["yes", "no", "maybe later", 'say "hi"', "café ☕"]
# GBNF (llama.cpp syntax) for key=value lists; PAIRS_REGEX is the same language.
PAIRS_GBNF = r'''root ::= pair ("," pair){0,3}
pair ::= key "=" value
key ::= [a-z]{1,8}
value ::= [0-9]{1,4} | "true" | "false"
'''
PAIRS_REGEX = r"[a-z]{1,8}=([0-9]{1,4}|true|false)(,[a-z]{1,8}=([0-9]{1,4}|true|false)){0,3}"


@pytest.fixture(scope="module")
def compiler(smollm2_dir) -> GrammarCompiler:
    compiler = GrammarCompiler.from_tokenizer_file(smollm2_dir / "tokenizer.json", 49152, [EOS])
    yield compiler
    compiler.shutdown()


@pytest.fixture(autouse=True)
def one_torch_thread():
    # [R, V] passes this small are slower on two threads of a shared CPU than on one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def punctuation_prior(smollm2) -> torch.Tensor:
    """[V] float32: +6 for eos and tokens made only of JSON punctuation/space, else 0."""
    prior = torch.zeros(smollm2.get_vocab_size())
    for token_id in range(smollm2.get_vocab_size()):
        text = smollm2.decode([token_id])
        if text and set(text) <= set('"{}[],: '):
            prior[token_id] = 6.0
    prior[EOS] = 6.0
    return prior


def sample_outputs(compiler: GrammarCompiler, constraint: Constraint, smollm2, prior: torch.Tensor,
                   num_rows: int = OUTPUTS_PER_SEED) -> list[str]:
    """Draws num_rows outputs per seed at temperature 1.0, all rows of a seed in one batch,
    masking every row every step; a row that runs past MAX_STEPS fails the test.

    Per seed the fake model's logits are prior + N(0, 1) noise drawn once (a model that ignores
    its context); each step's draw from softmax(masked logits) is fresh.
    """
    grammar = compiler.compile(constraint)
    filler = TokenBitmaskFiller(compiler.vocab_size)
    texts = []
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(seed)
        model_logits = torch.randn(prior.shape[0], generator=gen).add_(prior)  # [V]
        matchers = [grammar.new_matcher() for _ in range(num_rows)]
        tokens: list[list[int]] = [[] for _ in range(num_rows)]
        live = list(range(num_rows))
        for _ in range(MAX_STEPS):
            if not live:
                break
            logits = model_logits.expand(len(live), -1).clone()  # [R, V]
            apply_token_bitmask_(logits, filler.fill([matchers[i] for i in live]))
            # Gumbel-max: argmax(logits - log(-log U)), U ~ U(0, 1), is a draw from softmax(logits),
            # in fewer passes over [R, V] than softmax + multinomial (or a seeded exponential_).
            noise = torch.rand(logits.shape, generator=gen).log_().neg_().log_()  # [R, V]
            drawn = logits.sub_(noise).argmax(dim=-1)
            still_live = []
            for row, token in zip(live, drawn.tolist(), strict=True):
                if token == EOS:
                    continue
                assert matchers[row].accept_token(token), matchers[row].error
                tokens[row].append(token)
                if not matchers[row].is_finished:
                    still_live.append(row)
            live = still_live
        assert not live, f"{len(live)} outputs did not finish in {MAX_STEPS} steps"
        texts += [smollm2.decode(t) for t in tokens]
    return texts


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_json_validates_against_schema(name, compiler, smollm2, punctuation_prior):
    schema = SCHEMAS[name]
    texts = sample_outputs(compiler, Constraint("json_schema", json.dumps(schema)), smollm2, punctuation_prior)
    assert len(texts) == len(SEEDS) * OUTPUTS_PER_SEED
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) >= 20, "temperature 1.0 should give varied outputs"


def test_json_object_takes_any_object_and_only_an_object(compiler, smollm2):
    # Free-form objects have unbounded keys, so the fake model would not end them quickly:
    # check the language directly instead of by sampling.
    grammar = compiler.compile(Constraint("json_object", ""))
    matcher = grammar.new_matcher()
    for token in smollm2.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False).ids:
        assert matcher.accept_token(token), matcher.error
    assert matcher.is_finished
    assert not grammar.new_matcher().accept_token(smollm2.token_to_id("["))


def test_sampled_regex_outputs_match(compiler, smollm2, punctuation_prior):
    texts = sample_outputs(compiler, Constraint("regex", EMAIL_REGEX), smollm2, punctuation_prior)
    for text in texts:
        assert re.fullmatch(EMAIL_REGEX, text), text
    assert len(set(texts)) > 50


def test_sampled_choices_are_members(compiler, smollm2, punctuation_prior):
    texts = sample_outputs(compiler, Constraint("choice", json.dumps(CHOICES)), smollm2, punctuation_prior)
    assert set(texts) <= set(CHOICES)
    assert len(set(texts)) >= 3


def test_choices_are_literal_and_many_are_taken(compiler, smollm2):
    """choice is one regex of the escaped strings: as Lark alternatives, more than 2000 compiled
    but the parser refused its first token (review 88)."""
    special = ["a.b", "(x|y)", "1+1=2?", "$^[]{}#&-~\\", "new\nline", "é ü"]
    choices = [f"c{i}" for i in range(3000)] + special
    grammar = compiler.compile(Constraint("choice", json.dumps(choices)))

    def takes(text: str) -> bool:
        matcher = grammar.new_matcher()
        return all(matcher.accept_token(t) for t in smollm2.encode(text, add_special_tokens=False).ids) \
            and matcher.is_finished

    assert all(takes(text) for text in [*special, "c0", "c2999", "c300"])
    assert not any(takes(text) for text in ["axb", "x", "c3000", "1+1=2", "c"])


def test_sampled_gbnf_outputs_are_in_the_language(compiler, smollm2, punctuation_prior):
    texts = sample_outputs(compiler, Constraint("grammar", PAIRS_GBNF), smollm2, punctuation_prior)
    for text in texts:
        assert re.fullmatch(PAIRS_REGEX, text), text


@pytest.mark.parametrize(("constraint", "message"), [
    (Constraint("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (Constraint("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (Constraint("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
    (Constraint("json_schema", '{"type": "object",'), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
    (Constraint("json_schema", "true"), "must be a JSON object"),
    (Constraint("regex", "(ab"), "unclosed group"),
    (Constraint("grammar", "root ::= missing_rule"), "missing_rule"),
    (Constraint("grammar", "  "), "grammar is empty"),
    (Constraint("choice", "[]"), "at least one"),
    (Constraint("choice", '["a", ""]'), "non-empty strings"),
    (Constraint("json_schema", "[" * 50000 + "]" * 50000), "recursion"),
    (Constraint("choice", "[" * 50000 + "]" * 50000), "recursion"),
    # No text at all: llguidance says so only at the first mask (it allowed eos alone: review 103).
    (Constraint("regex", r"[^\s\S]"), "no text matches it"),
    (Constraint("grammar", "start: /[^\\s\\S]/"), "no text matches it"),
    (Constraint("regex", r"(ab)*[^\s\S]"), "no text matches it"),
])
def test_uncompilable_constraints_raise_clear_errors(compiler, constraint, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        compiler.compile(constraint)
    # The failure is cached: the same constraint fails again without a recompile.
    assert compiler.submit(constraint) is compiler.submit(constraint)


def test_cache_is_keyed_by_constraint_and_bounded(smollm2_dir):
    compiler = GrammarCompiler.from_tokenizer_file(smollm2_dir / "tokenizer.json", 49152, [EOS], cache_size=2)
    try:
        a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
        first = compiler.compile(a)
        assert compiler.compile(Constraint("regex", "a+")) is first
        compiler.compile(b)
        compiler.compile(c)  # evicts a, the least recently used
        assert compiler.compile(a) is not first
    finally:
        compiler.shutdown()


def test_cache_is_bounded_by_its_constraints_text_too(smollm2_dir):
    """A compiled grammar holds about 12 times its text: 256 big choice lists grew a worker by
    ~9 GB when only the count was bounded (review 103). The newest entry stays whatever its size."""
    compiler = GrammarCompiler.from_tokenizer_file(smollm2_dir / "tokenizer.json", 49152, [EOS], max_cached_chars=100)
    try:
        small = [Constraint("regex", f"{letter}+") for letter in "abcd"]  # 2 characters each
        big = Constraint("choice", json.dumps(["x" * 60]))  # 66 characters
        kept = [compiler.compile(c) for c in small]
        first_big = compiler.compile(big)
        assert [compiler.compile(c) for c in small[2:]] == kept[2:]  # 74 characters: all stay
        huge = Constraint("regex", "y" * 150)  # over the budget alone
        compiler.compile(huge)
        assert list(compiler._cache) == [huge] and compiler._cached_chars == 150
        assert compiler.compile(big) is not first_big  # compiled again
        assert list(compiler._cache) == [big] and compiler._cached_chars == len(big.text)
    finally:
        compiler.shutdown()


def test_finished_grammar_allows_only_eos(compiler, smollm2):
    matcher = compiler.compile(Constraint("choice", '["yes", "no"]')).new_matcher()
    filler = TokenBitmaskFiller(compiler.vocab_size)
    first = unpack_bitmask(filler.fill([matcher]), compiler.vocab_size)[0]
    assert {smollm2.decode([t]) for t in first.nonzero()[:, 0].tolist()} >= {"y", "n", "yes", "no"}
    assert not first[EOS]
    for token in smollm2.encode("yes", add_special_tokens=False).ids:
        assert matcher.accept_token(token)
    assert matcher.is_finished
    assert unpack_bitmask(filler.fill([matcher]), compiler.vocab_size)[0].nonzero()[:, 0].tolist() == [EOS]


def test_forked_matchers_advance_independently(compiler, smollm2):
    matcher = compiler.compile(Constraint("choice", '["yes sir", "yes madam"]')).new_matcher()
    for token in smollm2.encode("yes", add_special_tokens=False).ids:
        assert matcher.accept_token(token)
    fork = matcher.fork()
    for m, rest in ((matcher, " sir"), (fork, " madam")):
        for token in smollm2.encode(rest, add_special_tokens=False).ids:
            assert m.accept_token(token), m.error
        assert m.is_finished


def test_rejected_token_puts_matcher_in_error(compiler, smollm2):
    matcher = compiler.compile(Constraint("choice", '["yes", "no"]')).new_matcher()
    assert not matcher.accept_token(smollm2.token_to_id("{"))
    assert matcher.error and not matcher.is_finished


def test_bitmask_touches_only_constrained_rows(compiler):
    grammar = compiler.compile(Constraint("choice", '["yes", "no"]'))
    filler = TokenBitmaskFiller(compiler.vocab_size)
    assert filler.fill([None, None]) is None  # nothing constrained: no mask at all
    logits = torch.randn(5, compiler.vocab_size)
    before = logits.clone()
    bitmask = filler.fill([None, grammar.new_matcher(), None, grammar.new_matcher(), None])  # [5, W]
    assert bitmask.shape == (5, (compiler.vocab_size + 31) // 32)
    apply_token_bitmask_(logits, bitmask)
    for row in (0, 2, 4):
        assert (bitmask[row] == -1).all()
        assert torch.equal(logits[row], before[row])
    allowed = unpack_bitmask(bitmask, compiler.vocab_size)
    for row in (1, 3):
        assert torch.equal(logits[row][allowed[row]], before[row][allowed[row]])
        assert torch.isneginf(logits[row][~allowed[row]]).all()
        assert 2 <= int(allowed[row].sum()) < 50


def test_bitmask_of_a_fully_constrained_batch(compiler):
    grammar = compiler.compile(Constraint("regex", "[0-9]+"))
    filler = TokenBitmaskFiller(compiler.vocab_size)
    logits = torch.zeros(3, compiler.vocab_size)
    apply_token_bitmask_(logits, filler.fill([grammar.new_matcher() for _ in range(3)]))
    finite = torch.isfinite(logits)
    assert torch.equal(finite[0], finite[2]) and 10 <= int(finite[0].sum()) < 2000


@pytest.mark.parametrize("unpack", [unpack_bitmask, unpack_bitmask_torch])
def test_unpack_bitmask_bit_order(unpack):
    bitmask = torch.tensor([[1 | (1 << 9), 0, -(2**31)]], dtype=torch.int32)  # tokens 0, 9 and 95
    assert unpack(bitmask, 96)[0].nonzero()[:, 0].tolist() == [0, 9, 95]
    assert unpack(bitmask, 90).shape == (1, 90)
    random_words = torch.randint(-(2**31), 2**31 - 1, (4, 50), dtype=torch.int32)
    assert torch.equal(unpack(random_words, 1590), unpack_bitmask(random_words, 1590))


def test_constraint_from_proto():
    assert constraint_from_proto(pb.StructuredOutput()) is None
    assert constraint_from_proto(pb.StructuredOutput(json_object=False)) is None
    assert constraint_from_proto(pb.StructuredOutput(json_object=True)) == Constraint("json_object", "")
    assert constraint_from_proto(pb.StructuredOutput(regex="a+")) == Constraint("regex", "a+")
    assert constraint_from_proto(pb.StructuredOutput(json_schema="{}")) == Constraint("json_schema", "{}")
    assert constraint_from_proto(pb.StructuredOutput(grammar='root ::= "a"')) == Constraint("grammar", 'root ::= "a"')
    choice = constraint_from_proto(pb.StructuredOutput(choice=pb.StructuredOutput.Choice(choices=["a", "é"])))
    assert choice.kind == "choice" and json.loads(choice.text) == ["a", "é"]
