"""Structured output inside the engine (tiny random model, real SmolLM2 tokenizer): constrained and
unconstrained requests share steps, every sampler setting and n > 1 keep outputs valid, and the
engine loop refuses a constraint that does not compile with INVALID_ARGUMENT."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
import torch

from model_worker.engine import GrammarWait, LLMEngine, RequestRejected
from model_worker.engine_loop import EngineLoop, NewRequest, RequestFailure, StreamOutbox
from model_worker.model_runner import ModelRunner
from model_worker.sequence import FinishReason, SamplerOrder, SamplingParams
from model_worker.structured_output import Constraint, GrammarCompiler
from tests.test_engine_loop import collect

CPU = torch.device("cpu")
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "count": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ok": {"type": "boolean"}},
    "required": ["name", "count", "ok"], "additionalProperties": False,
}
PROMPT = [1, 4093, 198, 19556, 28, 253]


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir, "dummy", CPU, torch.float32, max_num_seqs=16, max_model_len=256)


@pytest.fixture(scope="module")
def compiler(tiny_model_dir, runner):
    compiler = GrammarCompiler.from_tokenizer_file(tiny_model_dir / "tokenizer.json", runner.vocab_size, [EOS])
    yield compiler
    compiler.shutdown()


def new_engine(runner) -> LLMEngine:
    return LLMEngine(runner, [EOS], max_num_seqs=16, max_num_batched_tokens=512, max_waiting_requests=100)


def run(engine: LLMEngine) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], FinishReason], list[set]]:
    """Steps the engine dry -> tokens and finish reason per (request, index), and the requests
    that got a token in each step."""
    tokens: dict[tuple[int, int], list[int]] = {}
    finish: dict[tuple[int, int], FinishReason] = {}
    steps = []
    while engine.has_work():
        outputs = engine.step()
        steps.append({o.seq_id for o in outputs if o.token_id is not None})
        for out in outputs:
            key = (out.seq_id, out.index)
            if out.token_id is not None:
                tokens.setdefault(key, []).append(out.token_id)
            if out.finish_reason != FinishReason.NONE:
                finish[key] = out.finish_reason
    return tokens, finish, steps


def text_of(smollm2, token_ids: list[int]) -> str:
    return smollm2.decode([t for t in token_ids if t != EOS])


def test_json_schema_request_shares_steps_with_an_unconstrained_one(runner, compiler, smollm2):
    engine = new_engine(runner)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=7), 120, [], False, grammar=grammar)
    engine.add_request(2, PROMPT, SamplingParams(temperature=1.0, seed=7), 24, [], True)
    tokens, finish, steps = run(engine)
    document = json.loads(text_of(smollm2, tokens[(1, 0)]))
    jsonschema.validate(document, SCHEMA)
    assert finish[(1, 0)] == FinishReason.STOP
    # The free request drew from the whole vocabulary in the same steps: its random-model text
    # is not JSON, and it ran to its length limit.
    assert finish[(2, 0)] == FinishReason.LENGTH and len(tokens[(2, 0)]) == 24
    assert not text_of(smollm2, tokens[(2, 0)]).startswith("{")
    assert sum(1 for s in steps if s == {1, 2}) >= 5


@pytest.mark.parametrize("sampling", [
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05, seed=3),
    SamplingParams(temperature=1.0, typical_p=0.9, top_n_sigma=2.0, xtc_probability=0.5, xtc_threshold=0.05,
                   seed=4, sampler_order=SamplerOrder.LLAMA_CPP),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                   dry_multiplier=0.8, repeat_penalty=1.2, seed=5),
    # A huge bias towards "[" (token 75, never allowed by the schema) and mirostat: the mask wins.
    SamplingParams(temperature=1.0, mirostat=2, logit_bias=((75, 30.0),), seed=6, logprobs=True, top_logprobs=2),
    # min_tokens masks eos early; ignore_eos is not set, so eos may end a complete document.
    SamplingParams(temperature=1.0, min_tokens=3, seed=8),
])
def test_every_sampler_setting_keeps_the_output_valid(runner, compiler, smollm2, sampling):
    engine = new_engine(runner)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    engine.add_request(1, PROMPT, sampling, 120, [], False, n=2, grammar=grammar)
    tokens, finish, _ = run(engine)
    for index in (0, 1):
        jsonschema.validate(json.loads(text_of(smollm2, tokens[(1, index)])), SCHEMA)
        assert finish[(1, index)] == FinishReason.STOP


def test_regex_and_choice_requests(runner, compiler, smollm2):
    engine = new_engine(runner)
    regex = r"[a-z]{2,6}-[0-9]{2}"
    choices = ["alpha", "beta", "gamma delta"]
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=1), 40, [], False, n=3,
                       grammar=compiler.compile(Constraint("regex", regex)))
    engine.add_request(2, PROMPT, SamplingParams(temperature=1.0, seed=2), 40, [], False, n=3,
                       grammar=compiler.compile(Constraint("choice", json.dumps(choices))))
    tokens, finish, _ = run(engine)
    for index in range(3):
        assert re.fullmatch(regex, text_of(smollm2, tokens[(1, index)]))
        assert text_of(smollm2, tokens[(2, index)]) in choices
        assert finish[(1, index)] == finish[(2, index)] == FinishReason.STOP


def test_a_grammar_after_tokens_starts_once_the_output_holds_them(runner, compiler, smollm2):
    # A reasoning model's thinking is free until its </think>: the grammar starts on the token after.
    free = new_engine(runner)
    free.add_request(1, PROMPT, SamplingParams(temperature=0.0), 6, [], True)
    unconstrained = run(free)[0][(1, 0)]
    engine = new_engine(runner)
    choices = ["alpha", "beta"]
    grammar = compiler.compile(Constraint("choice", json.dumps(choices)))
    trigger = tuple(unconstrained[:2])  # what the model writes on its own first
    engine.add_request(1, PROMPT, SamplingParams(temperature=0.0), 40, [], False, grammar=grammar,
                       grammar_wait=GrammarWait(trigger))
    # Never written: the output stays free to its length.
    engine.add_request(2, PROMPT, SamplingParams(temperature=0.0), 6, [], True, grammar=grammar,
                       grammar_wait=GrammarWait((EOS, EOS)))
    # Forked samples each wait for their own trigger (a biased token, so every sample writes it).
    engine.add_request(3, PROMPT, SamplingParams(temperature=1.0, seed=3, logit_bias=((28, 100.0),)), 40, [], False,
                       n=3, grammar=grammar, grammar_wait=GrammarWait((28,)))
    tokens, finish, _ = run(engine)
    assert tokens[(1, 0)][:2] == unconstrained[:2]
    assert text_of(smollm2, tokens[(1, 0)][2:]) in choices and finish[(1, 0)] == FinishReason.STOP
    assert tokens[(2, 0)] == unconstrained and finish[(2, 0)] == FinishReason.LENGTH
    for index in range(3):
        assert tokens[(3, index)][0] == 28 and finish[(3, index)] == FinishReason.STOP
        assert text_of(smollm2, tokens[(3, index)][1:]) in choices
    assert not engine._grammar_waits and not engine._grammars


def test_a_wait_with_an_opener_waits_only_where_the_first_token_is_it(runner, compiler, smollm2):
    # Qwen3's thinking mode may open with <think> or answer at once: the first token may be the
    # opener (then free until the end tag) or the grammar's own (then constrained from it on).
    choices = ["alpha", "beta"]
    grammar = compiler.compile(Constraint("choice", json.dumps(choices)))
    opener, end = 28, 29
    engine = new_engine(runner)
    # Biased to open (the end tag more, but the first token is the grammar's or the opener): thinks
    # (free, and the end tag comes at once), then answers in the grammar.
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=5, logit_bias=((opener, 50.0), (end, 100.0))),
                       40, [], False, n=2, grammar=grammar, grammar_wait=GrammarWait((end,), opener))
    # Not opening (biased away from the opener, toward the end tag, which the grammar masks): the
    # first token is the grammar's, and the output is a choice from its start.
    engine.add_request(2, PROMPT, SamplingParams(temperature=1.0, seed=6, logit_bias=((opener, -100.0), (end, 100.0))),
                       40, [], False, n=2, grammar=grammar, grammar_wait=GrammarWait((end,), opener))
    tokens, finish, _ = run(engine)
    for index in (0, 1):
        assert tokens[(1, index)][:2] == [opener, end]
        assert text_of(smollm2, tokens[(1, index)][2:]) in choices
        assert text_of(smollm2, tokens[(2, index)]) in choices
        assert finish[(1, index)] == finish[(2, index)] == FinishReason.STOP
    assert not engine._grammar_waits


def test_grammar_after_tokens_outside_the_vocabulary_are_refused(runner, compiler):
    engine = new_engine(runner)
    grammar = compiler.compile(Constraint("choice", '["yes", "no"]'))
    with pytest.raises(RequestRejected, match="after_token_ids") as info:
        engine.add_request(1, PROMPT, SamplingParams(), 10, [], False, grammar=grammar,
                           grammar_wait=GrammarWait((runner.vocab_size,)))
    assert info.value.field == "structured_output" and not engine.has_work()


def test_a_sample_left_with_no_allowed_token_ends_with_error(runner, compiler):
    # allowed_token_ids disjoint from the grammar leaves nothing to draw: the sample ends, no crash.
    engine = new_engine(runner)
    grammar = compiler.compile(Constraint("choice", '["yes", "no"]'))
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=1, allowed_token_ids=(75,)), 10, [], False,
                       grammar=grammar)
    engine.add_request(2, PROMPT, SamplingParams(temperature=1.0, seed=1), 5, [], True)
    tokens, finish, _ = run(engine)
    assert finish[(1, 0)] == FinishReason.ERROR and len(tokens[(1, 0)]) == 1
    assert finish[(2, 0)] == FinishReason.LENGTH and len(tokens[(2, 0)]) == 5


def test_a_grammar_its_parser_refuses_says_so(runner, compiler):
    """A GBNF of 3000 alternatives compiles, then llguidance's parser refuses its first token (a
    row of more than 2000 items): the error says that, on structured_output, not that no token was
    left to the request's allowed_token_ids, bad_words and min_tokens, which it never set (review 88)."""
    engine = new_engine(runner)
    grammar = compiler.compile(Constraint("grammar", "root ::= " + " | ".join(f'"c{i}"' for i in range(3000))))
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=1), 10, [], False, grammar=grammar)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    last = outputs[-1]
    assert last.finish_reason == FinishReason.ERROR and last.error_field == "structured_output", last
    assert "structured output grammar took no more after 0 output tokens" in last.error and "2000" in last.error
    # Nothing left to draw (allowed_token_ids against the grammar) keeps its own message.
    engine.add_request(2, PROMPT, SamplingParams(temperature=1.0, seed=1, allowed_token_ids=(75,)), 10, [], False,
                       grammar=compiler.compile(Constraint("choice", '["yes", "no"]')))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert outputs[-1].error.startswith("no token was left") and outputs[-1].error_field == ""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_grammar_that_reaches_a_dead_end_ends_with_its_error_not_a_stop(runner, compiler, smollm2, seed):
    """The grammar's prefix is fine, then nothing can follow: llguidance's mask allows only eos,
    which ended the output as a success ('{"k": ', finish STOP) breaking its constraint (review 103)."""
    engine = new_engine(runner)
    grammar = compiler.compile(Constraint("grammar", 'start: "{\\"k\\": " DEAD "}"\nDEAD: /[^\\s\\S]/'))
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=seed), 50, [], False, grammar=grammar)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    last = outputs[-1]
    assert last.finish_reason == FinishReason.ERROR and last.error_field == "structured_output", last
    assert "no text the grammar allows can follow" in last.error
    assert text_of(smollm2, [o.token_id for o in outputs if o.token_id is not None]) == '{"k": '
    assert last.stop_token_id is None


def test_sampler_noise_never_overrides_a_mask():
    # A Gumbel draw of +inf (a uniform that rounded to 1.0) beat every -inf mask, grammar or filter:
    # ~0.35% of rows per step drew a forbidden token before counter_random clamped its uniforms.
    from model_worker.sampling.counter_random import _uniform_bits, column_counters, gumbel_noise

    keys = torch.arange(1000, dtype=torch.int32) * 7919
    columns = column_counters(49152, CPU)
    assert (_uniform_bits(keys, columns) == 2**24 - 1).any()  # the case that used to give +inf is here
    assert torch.isfinite(gumbel_noise(keys, columns)).all()


async def test_engine_loop_compiles_off_the_step_and_refuses_bad_constraints(runner, compiler, smollm2):
    loop = EngineLoop(new_engine(runner), compiler)
    loop.start()
    try:
        outbox = StreamOutbox()

        def request(request_id: str, constraint: Constraint | None) -> NewRequest:
            return NewRequest(request_id=request_id, prompt_token_ids=PROMPT,
                              sampling=SamplingParams(temperature=1.0, seed=9), max_tokens=60, stop_token_ids=[],
                              ignore_eos=False, constraint=constraint)

        loop.add(outbox, request("bad", Constraint("json_schema", '{"type": "array", "uniqueItems": true}')))
        loop.add(outbox, request("good", Constraint("json_schema", json.dumps(SCHEMA))))
        loop.add(outbox, request("free", None))
        items = await collect(outbox, {"bad", "good", "free"}, timeout_s=60)
        [failure] = items["bad"]
        assert isinstance(failure, RequestFailure)
        assert failure.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "uniqueItems" in failure.message
        good = items["good"]
        jsonschema.validate(json.loads(text_of(smollm2, [o.token_id for o in good if o.token_id is not None])),
                            SCHEMA)
        assert good[-1].finish_reason == FinishReason.STOP
        assert items["free"][-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert not outbox.live
    finally:
        await loop.stop()


@pytest.mark.parametrize("best_of", [4, 6], ids=["n", "best_of"])
def test_an_error_ends_every_sample_of_its_request(runner, compiler, smollm2, best_of):
    """One sample's grammar dead end (FINISH_REASON_ERROR) ends the whole request, as the proto
    says and the gateway takes it: the error is the request's last output, and its other samples
    stop there (they went on to max_tokens, holding their seats and blocks, for nobody)."""
    a, b, c = (smollm2.token_to_id(ch) for ch in "abc")  # "d" is not allowed: "c" is a dead end
    grammar_of = lambda: compiler.compile(Constraint("regex", "(ab{1,150}|cd)"))  # noqa: E731
    errors = 0
    for seed in range(4):
        engine = new_engine(runner)
        engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=(a, b, c)), 100,
                           [], False, n=4, best_of=best_of, grammar=grammar_of())
        engine.add_request(2, PROMPT, SamplingParams(temperature=1.0, seed=seed), 30, [], True)
        outputs = []
        while engine.has_work():
            outputs += engine.step()
        mine = [o for o in outputs if o.seq_id == 1]
        assert sum(o.request_finished for o in mine) == 1 and mine[-1].request_finished
        other = [o for o in outputs if o.seq_id == 2]
        assert len(other) == 30 and other[-1].finish_reason == FinishReason.LENGTH
        assert engine.block_manager.num_used_blocks == 0 and not engine.groups
        if mine[-1].finish_reason == FinishReason.ERROR:
            errors += 1
            assert mine[-1].error and len(mine) < 4 * 100  # the others did not run on to max_tokens
            assert all(o.finish_reason != FinishReason.ERROR for o in mine[:-1])
    assert errors >= 2  # most seeds draw a "c" in one of the samples


def test_a_grammar_the_requests_own_bad_words_empty_ends_with_the_no_token_left_error(runner, compiler, smollm2):
    # The grammar takes only "x", a bad word here: token 0 was drawn and the error blamed the grammar
    # (its param, structured_output) where the request's own masks left nothing (review 100).
    x = smollm2.encode("x", add_special_tokens=False).ids
    engine = new_engine(runner)
    engine.add_request(1, PROMPT, SamplingParams(temperature=1.0, seed=1, bad_words=(tuple(x),)), 8, [], False,
                       grammar=compiler.compile(Constraint("regex", "x")))
    engine.add_request(2, PROMPT, SamplingParams(), 3, [], True, grammar=compiler.compile(Constraint("regex", "x+")))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    (mine,) = [o for o in outputs if o.seq_id == 1]
    assert mine.finish_reason == FinishReason.ERROR and "no token was left" in mine.error and not mine.error_field
    other = [o for o in outputs if o.seq_id == 2]  # a grammar without bad words beside it goes on
    assert set(text_of(smollm2, [o.token_id for o in other])) == {"x"} and other[-1].finish_reason == FinishReason.LENGTH
