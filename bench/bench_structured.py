"""Structured output cost: the sampler step of a batch of 32 with 0%, 50% and 100% of its rows
under a JSON schema (bitmask fill + masked sampling + matcher advance), side by side in one run;
with --engine, the full engine step (SmolLM2-135M forward + sampler) instead; and, with
--compare-engines, llguidance against xgrammar on the SmolLM2 tokenizer.

Sits beside the model worker: drives model_worker.sampling.Sampler through its bitmask hook with
the same GrammarCompiler / TokenBitmaskFiller the engine uses. The fake model's logits are random
plus a preference for JSON punctuation, so outputs end and matchers cycle through whole documents.

    .venv/bin/python bench/bench_structured.py --threads 1
    .venv/bin/python bench/bench_structured.py --threads 1 --engine
    .venv/bin/python bench/bench_structured.py --compare-engines   # needs xgrammar installed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from model_worker.host_memory import keep_freed_memory_in_heap  # noqa: E402
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from model_worker.sampling import Sampler  # noqa: E402
from model_worker.sequence import SamplingParams, Sequence  # noqa: E402
from model_worker.structured_output import (  # noqa: E402
    Constraint,
    GrammarCompiler,
    GrammarMatcher,
    TokenBitmaskFiller,
)

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "note": {"type": "string", "maxLength": 24},
    },
    "required": ["id", "status", "items", "note"], "additionalProperties": False,
}
# The engine bench's constraint: at least 40 items, so no document ends inside the timed steps
# and the batch stays at its full size.
LONG_SCHEMA = {"type": "array", "items": SCHEMA["properties"]["items"]["items"], "minItems": 40, "maxItems": 50}
FRACTIONS = (0.0, 0.5, 1.0)


def punctuation_prior(tokenizer, vocab_size: int) -> torch.Tensor:
    """[V]: +6 for eos and tokens made only of JSON punctuation and spaces."""
    prior = torch.zeros(vocab_size)
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id])
        if text and set(text) <= set('"{}[],: '):
            prior[token_id] = 6.0
    prior[EOS] = 6.0
    return prior


class Case:
    """One batch: its sequences, its own Sampler (so the batch view is reused step to step, as in
    the engine) and a matcher for each constrained row, replaced when its document ends."""

    def __init__(self, fraction: float, batch: int, vocab: int, compiler: GrammarCompiler, params: SamplingParams):
        self.grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
        self.sampler = Sampler(vocab, torch.device("cpu"))
        self.filler = TokenBitmaskFiller(vocab)
        num_constrained = round(fraction * batch)
        self.seqs = [Sequence(seq_id=i, prompt_token_ids=[1, 2, 3], sampling=params, max_tokens=10**6,
                              stop_token_ids=frozenset({EOS})) for i in range(batch)]
        # Constrained rows interleaved with free ones, as a real batch would mix them.
        stride = batch / num_constrained if num_constrained else 0
        rows = {int(i * stride) for i in range(num_constrained)}
        self.matchers: list[GrammarMatcher | None] = [
            self.grammar.new_matcher() if row in rows else None for row in range(batch)]
        self.documents = 0

    def step(self, logits: torch.Tensor) -> dict[str, float]:
        """One sampler step on logits [S, V]; returns seconds per part."""
        t0 = time.perf_counter()
        bitmask = self.filler.fill(self.matchers)  # [S, W] or None
        t1 = time.perf_counter()
        token_ids = self.sampler.sample(logits, self.seqs, allowed_token_bitmask=bitmask).token_ids.tolist()
        t2 = time.perf_counter()
        for row, (seq, token) in enumerate(zip(self.seqs, token_ids, strict=True)):
            seq.output_token_ids.append(token)
            matcher = self.matchers[row]
            if matcher is None:
                continue
            if token == EOS or (matcher.accept_token(token) and matcher.is_finished):
                self.matchers[row] = self.grammar.new_matcher()
                self.documents += 1
            elif matcher.error:
                raise AssertionError(f"the sampler drew a token the grammar forbids: {matcher.error}")
        t3 = time.perf_counter()
        return {"fill": t1 - t0, "sample": t2 - t1, "advance": t3 - t2, "total": t3 - t0}


def bench_steps(args: argparse.Namespace, compiler: GrammarCompiler, prior: torch.Tensor) -> list[dict]:
    vocab = prior.shape[0]
    # Temperature only: a chain whose cost does not depend on how many tokens the mask leaves
    # (top-p sorts cost less on masked rows, which would hide the overhead).
    params = SamplingParams(temperature=1.0, seed=1)
    cases = {f: Case(f, args.batch, vocab, compiler, params) for f in FRACTIONS}
    gen = torch.Generator().manual_seed(0)
    times: dict[float, list[dict[str, float]]] = {f: [] for f in FRACTIONS}
    for step in range(args.warmup + args.steps):
        logits = torch.randn(args.batch, vocab, generator=gen).add_(prior)  # [S, V]
        # Interleaved: every case sees the same logits and the same moment of machine load.
        for fraction, case in cases.items():
            parts = case.step(logits.clone())
            if step >= args.warmup:
                times[fraction].append(parts)
    base = statistics.median(t["total"] for t in times[0.0])
    rows = []
    print(f"| constrained rows (of {args.batch}) | step ms (median) | fill ms | sample ms | advance ms "
          f"| step / unconstrained | documents finished |")
    print("|---|---|---|---|---|---|---|")
    for fraction in FRACTIONS:
        med = {k: statistics.median(t[k] for t in times[fraction]) * 1e3 for k in ("total", "fill", "sample", "advance")}
        ratio = med["total"] / (base * 1e3)
        rows.append({"fraction": fraction, **{f"{k}_ms": v for k, v in med.items()}, "ratio": ratio,
                     "documents": cases[fraction].documents})
        print(f"| {round(fraction * args.batch)} ({fraction:.0%}) | {med['total']:.2f} | {med['fill']:.2f} | "
              f"{med['sample']:.2f} | {med['advance']:.2f} | {ratio:.2f}x | {cases[fraction].documents} |")
    return rows


def bench_engine(args: argparse.Namespace, compiler: GrammarCompiler, model_dir: Path) -> list[dict]:
    """Full engine steps (real SmolLM2 weights, CPU float32) of a decoding batch of args.batch: one
    runner and engine per case, their steps interleaved so each case sees the same machine load."""
    from model_worker.engine import LLMEngine
    from model_worker.model_runner import ModelRunner

    grammar = compiler.compile(Constraint("json_schema", json.dumps(LONG_SCHEMA)))
    prompt = [1, 4093, 198, 19556, 28, 253, 28, 5347, 198]
    engines = {}
    for fraction in FRACTIONS:
        runner = ModelRunner(model_dir, "auto", torch.device("cpu"), torch.float32, max_num_seqs=args.batch,
                             max_model_len=512)
        engine = engines[fraction] = LLMEngine(runner, [EOS], args.batch, 4096, 1024)
        num_constrained = round(fraction * args.batch)
        stride = args.batch / num_constrained if num_constrained else 0
        rows = {int(i * stride) for i in range(num_constrained)}
        for i in range(args.batch):
            engine.add_request(i, prompt + [100 + i], SamplingParams(temperature=1.0, seed=i), 400, [], True,
                               grammar=grammar if i in rows else None)
    times: dict[float, list[float]] = {f: [] for f in FRACTIONS}
    for step in range(args.warmup + args.engine_steps):  # the first step is the prefill
        for fraction, engine in engines.items():
            start = time.perf_counter()
            outputs = engine.step()
            if step >= args.warmup:
                times[fraction].append(time.perf_counter() - start)
                assert len(outputs) == args.batch and not any(o.request_finished for o in outputs)
    base = statistics.median(times[0.0])
    rows_out = []
    print(f"| constrained rows (of {args.batch}) | engine step ms (median) | step / unconstrained |")
    print("|---|---|---|")
    for fraction in FRACTIONS:
        med = statistics.median(times[fraction])
        rows_out.append({"fraction": fraction, "step_ms": med * 1e3, "ratio": med / base})
        print(f"| {round(fraction * args.batch)} ({fraction:.0%}) | {med * 1e3:.1f} | {med / base:.3f}x |")
    return rows_out


def bench_compile(compiler_factory) -> None:
    """Cold compile (fresh cache) vs cache hit for the benchmark schema."""
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    compiler = compiler_factory()
    start = time.perf_counter()
    compiler.compile(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(constraint)
    hit = time.perf_counter() - start
    compiler.shutdown()
    print(f"\ncompile of the schema: cold {cold * 1e3:.2f} ms, cache hit {hit * 1e3:.3f} ms")


def compare_engines(tokenizer_json: Path, vocab: int) -> None:
    """llguidance vs xgrammar: compile time and per-token mask time (thread CPU time, so the
    figures survive a loaded machine) for the tests' five schemas, a regex and a GBNF grammar."""
    import llguidance
    import llguidance.torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from test_structured_output import EMAIL_REGEX, PAIRS_GBNF, SCHEMAS

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    xgr_info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[EOS])
    ll_tokenizer = llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab, eos_token=[EOS])
    items = [("json_schema", k, json.dumps(v)) for k, v in SCHEMAS.items()]
    items += [("regex", "email", EMAIL_REGEX), ("grammar", "pairs", PAIRS_GBNF)]

    def xgr_matcher(kind: str, text: str):
        compiler = xgrammar.GrammarCompiler(xgr_info, max_threads=1, cache_enabled=False)
        if kind == "json_schema":
            compiled = compiler.compile_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(text)
        else:
            compiled = compiler.compile_grammar(text)
        return xgrammar.GrammarMatcher(compiled)

    def llg_matcher(kind: str, text: str):
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.grammar_from("grammar", text)
        return llguidance.LLMatcher(ll_tokenizer, grammar)

    engines = {
        "xgrammar": (xgr_matcher, lambda m, bm: m.fill_next_token_bitmask(bm), lambda m, t: m.accept_token(t),
                     lambda m: m.is_terminated()),
        "llguidance": (llg_matcher, lambda m, bm: llguidance.torch.fill_next_token_bitmask(m, bm, 0),
                       lambda m, t: m.consume_token(t), lambda m: m.is_stopped()),
    }
    prior = torch.zeros(vocab)
    clock = time.thread_time
    print("| constraint | engine | compile ms (median of 5) | first mask ms | later masks ms (median) |")
    print("|---|---|---|---|---|")
    for kind, name, text in items:
        for engine, (make, fill, accept, done) in engines.items():
            compile_s, first_s, later_s = [], [], []
            for seed in range(5):
                start = clock()
                matcher = make(kind, text)
                compile_s.append(clock() - start)
                gen = torch.Generator().manual_seed(seed)
                bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
                for step in range(60):
                    start = clock()
                    fill(matcher, bitmask)
                    (first_s if step == 0 else later_s).append(clock() - start)
                    logits = torch.randn(1, vocab, generator=gen).add_(prior)
                    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
                    token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
                    if token == EOS or not accept(matcher, token) or done(matcher):
                        break
            print(f"| {kind} {name} | {engine} | {statistics.median(compile_s) * 1e3:.2f} | "
                  f"{statistics.median(first_s) * 1e3:.3f} | {statistics.median(later_s) * 1e3:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--engine", action="store_true", help="time full engine steps with the real model")
    parser.add_argument("--engine-steps", type=int, default=30, help="timed engine steps per case")
    parser.add_argument("--compare-engines", action="store_true", help="llguidance vs xgrammar instead")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    # The model worker's malloc settings: without them every fresh [S, V] tensor is a new mmap,
    # page-faulted in and unmapped each step, which moved the sampler's 6 ms to 11 ms here.
    keep_freed_memory_in_heap()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    model_dir = resolve_model_dir(DEFAULT_MODEL, Path.home() / ".cache" / "tokenwire")
    tokenizer_json = model_dir / "tokenizer.json"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if args.compare_engines:
        compare_engines(tokenizer_json, vocab)
        return

    def new_compiler() -> GrammarCompiler:
        return GrammarCompiler.from_tokenizer_file(tokenizer_json, vocab, [EOS])

    compiler = new_compiler()
    if args.engine:
        rows = bench_engine(args, compiler, model_dir)
    else:
        rows = bench_steps(args, compiler, punctuation_prior(Tokenizer.from_file(str(tokenizer_json)), vocab))
    bench_compile(new_compiler)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"batch": args.batch, "threads": args.threads, "engine": args.engine,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
