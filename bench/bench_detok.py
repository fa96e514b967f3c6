"""Detok throughput: the detok worker's frame loop against per-token alternatives, side by side.

Sits beside the detok worker, not in it: drives DetokenizeStream.apply directly (no gRPC) on
256 interleaved sequences with 2 stop strings each, next to tokenizers' DecodeStream, a bare
byte-table loop (each id's bytes from a list, decoded per row per frame: no stop strings, no held-back
characters, so not exact) and a naive full re-decode per token, all on the real SmolLM2 tokenizer
in one process. Frames carry 1, 4 or 16 tokens per sequence (--tokens-per-frame): one decode step,
or several coalesced under load. By default all sequences start together and finish in the last
frame; --staggered runs them as an engine's slots do (each of --sequences slots runs sequences of
1/4 to 7/4 x --tokens back to back, each opened in the frame of its first ids, for 3 x --tokens
frames, then drains), so some sequence finishes on most frames. Times are CPU seconds of this
process (time.process_time), which a busy shared machine inflates less than wall time; the last
columns are the ratios to DecodeStream and to the bare loop measured in the same run.

    .venv/bin/python bench/bench_detok.py --sequences 256 --tokens 128 --tokens-per-frame 1,4,16 [--staggered]
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Run as a script (`python bench/bench_detok.py`), sys.path[0] is bench/; the packages sit
# one level up and need not be pip-installed.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from detok_worker.stop_strings import StopStringMatcher  # noqa: E402
from detok_worker.stream import DetokenizeStream  # noqa: E402
from detok_worker.token_bytes import TokenizerDecoding  # noqa: E402
from detok_worker.token_table import token_table_for  # noqa: E402
from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir  # noqa: E402
from tokenwire.packing import pack_int32, unpack_int32  # noqa: E402
from tokenwire.v1 import common_pb2  # noqa: E402
from tokenwire.v1 import detok_worker_pb2 as pb  # noqa: E402

# Never in the corpus, so every sequence runs to its last token and matching is pure cost.
STOPS = ["\n\nObservation:", "</final_answer>"]
# Built in, so the ids (and the numbers) do not move when files in the repo change.
CORPUS = [
    "The café on the corner serves crème brûlée and naïve jokes to everyone who walks in. ",
    "Der Bär läuft über die Brücke, während die Größe der Straße überrascht. ",
    "Привет, как дела? Всё хорошо, спасибо. 東京は日本の首都です。中文文本也在这里。",
    "한국어 텍스트도 있습니다. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया. 🙂👍🏽🍣✨🇯🇵 ",
    "Streaming detokenization turns token ids into text a few ids at a time; a stop string "
    "may straddle two frames, and a character may straddle two tokens.\n",
    "def decode(ids: list[int]) -> str:\n    return b''.join(table[i] for i in ids).decode()\n\n",
    "| model | tokens/s | p50 ms |\n|---|---:|---:|\n| SmolLM2-135M | 1234.5 | 12.3 |\n",
    '{"role": "assistant", "content": "Sure! Here is the answer: 42."}\n',
]


def corpus_ids(tokenizer: Tokenizer) -> list[int]:
    """Realistic ids: prose, several scripts, emoji, code, markdown and JSON."""
    return tokenizer.encode("".join(CORPUS) * 8).ids


def sequences_ids(ids: list[int], num_sequences: int, num_tokens: int) -> list[list[int]]:
    stride = max(1, (len(ids) - num_tokens) // num_sequences)
    return [ids[i * stride:i * stride + num_tokens] for i in range(num_sequences)]


@dataclass
class Workload:
    """Sequences and the step at which each gets its first ids (and, if not at 0, is opened)."""

    seqs: list[list[int]]
    starts: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.seqs))


def staggered_workload(ids: list[int], starts_ok: list[bool], num_slots: int, num_tokens: int,
                       seed: int = 0) -> Workload:
    """Engine-like traffic: each slot runs sequences of num_tokens/4 to 7*num_tokens/4 ids back
    to back, opening new ones for 3 * num_tokens steps; a slot's first sequence is cut to a random
    remainder, as if it began before the run, so finishes are spread from the first steps on.
    Sequences are slices of ids that start where starts_ok (not inside a character, as generated
    text never does)."""
    rng = random.Random(seed)
    offsets = [offset for offset, ok in enumerate(starts_ok) if ok]
    seqs: list[list[int]] = []
    starts: list[int] = []
    low, high = max(1, num_tokens // 4), max(1, 7 * num_tokens // 4)
    for _ in range(num_slots):
        step = 0
        length = rng.randint(1, rng.randint(low, high))
        while step < 3 * num_tokens:
            offset = offsets[rng.randrange(bisect.bisect_right(offsets, len(ids) - length))]
            seqs.append(ids[offset:offset + length])
            starts.append(step)
            step += length
            length = rng.randint(low, high)
    return Workload(seqs, starts)


def step_rows(workload: Workload, tokens_per_frame: int) -> list[list[tuple[int, list[int], bool]]]:
    """Per frame: (sequence index, its ids in this frame, input finished) for each sequence with
    ids in it, in sequence order; a sequence starting at step s first appears in frame
    ceil(s / tokens_per_frame). Built frame by frame, so that a frame's rows lie together in
    memory as a frame that just arrived would (the bare loop is memory-bound otherwise)."""
    first_frames = [-(-start // tokens_per_frame) for start in workload.starts]
    by_first_frame: dict[int, list[int]] = {}
    for index, first in enumerate(first_frames):
        by_first_frame.setdefault(first, []).append(index)
    frames: list[list[tuple[int, list[int], bool]]] = []
    running: list[int] = []
    number = 0
    while running or number <= max(by_first_frame):
        running = sorted(running + by_first_frame.get(number, []))
        rows = []
        for index in running:
            ids = workload.seqs[index]
            start = (number - first_frames[index]) * tokens_per_frame
            rows.append((index, ids[start:start + tokens_per_frame], start + tokens_per_frame >= len(ids)))
        frames.append(rows)
        running = [index for index, _, finished in rows if not finished]
        number += 1
    return frames


def add_reply_text(texts: dict[str, str], names: list[str], reply: pb.TextDeltaFrame) -> None:
    """Appends a reply's text to texts (by sequence name): its TextDeltas, then its TextColumns
    rows (handle h is names[h - 1], as the column runs open them)."""
    for delta in reply.deltas:
        texts[delta.sequence_id] += delta.text
    columns = reply.columns
    offset = 0
    for handle, length in zip(unpack_int32(columns.handles).tolist(),
                              unpack_int32(columns.text_lengths).tolist(), strict=True):
        texts[names[handle - 1]] += columns.text[offset:offset + length].decode("utf-8")
        offset += length


def run_frame_loop(decoding: TokenizerDecoding, workload: Workload, tokens_per_frame: int,
                   columns: bool = False, one_id_loop: bool = True,
                   frame_seconds: list[float] | None = None) -> tuple[float, list[str]]:
    """Frames as the model worker's decode steps send them: every running sequence, a few ids
    each; as per-sequence SequenceTokenIds, or with columns in the column form (TokenColumns /
    TextColumns, OpenSequence.handle i + 1 for sequence i, finished in the frame of its last ids).
    Sequences starting at step 0 are opened before the clock starts, later ones in their first
    frame. one_id_loop=False decodes rows of one id with the numpy pass too
    (HandleTable.one_id_loop and few_rows_lane), for the side-by-side ratio. frame_seconds: if given, gets each
    frame's CPU time (the clock read per frame adds ~1 us to each)."""
    stream = DetokenizeStream(open_decoding=lambda _identity: decoding)
    stream._columns.one_id_loop = stream._columns.few_rows_lane = one_id_loop
    seqs = workload.seqs
    names = [f"seq-{i}" for i in range(len(seqs))]
    identity = common_pb2.TokenizerIdentity(path="bench")
    opens = [pb.OpenSequence(sequence_id=name, tokenizer=identity, skip_special_tokens=True, stop=STOPS,
                             handle=i + 1 if columns else 0) for i, name in enumerate(names)]
    stream.apply(pb.DetokenizeFrame(opens=[opens[i] for i, start in enumerate(workload.starts) if not start]))
    frames = []
    for number, rows in enumerate(step_rows(workload, tokens_per_frame)):
        frame = pb.DetokenizeFrame(opens=[opens[i] for i, _, _ in rows
                                          if workload.starts[i] and -(-workload.starts[i] // tokens_per_frame) == number])
        if columns:
            frame.columns.handles = pack_int32([i + 1 for i, _, _ in rows])
            frame.columns.num_tokens = pack_int32([len(ids) for _, ids, _ in rows])
            frame.columns.token_ids = pack_int32([t for _, ids, _ in rows for t in ids])
            frame.columns.finished_handles = pack_int32([i + 1 for i, _, finished in rows if finished])
        else:
            frame.tokens.extend(pb.SequenceTokenIds(sequence_id=names[i], token_ids=pack_int32(ids), finished=finished)
                                for i, ids, finished in rows)
        frames.append(frame)
    began = time.process_time()
    if frame_seconds is None:
        replies = [stream.apply(frame) for frame in frames]
    else:
        replies = []
        for frame in frames:
            frame_began = time.process_time()
            replies.append(stream.apply(frame))
            frame_seconds.append(time.process_time() - frame_began)
    seconds = time.process_time() - began
    texts = dict.fromkeys(names, "")
    for reply in replies:
        add_reply_text(texts, names, reply)
    return seconds, list(texts.values())


def run_decode_stream(tokenizer: Tokenizer, workload: Workload) -> tuple[float, list[str]]:
    """tokenizers' DecodeStream, one step() per token, sequences interleaved, stops matched too
    (stream and matcher made when a sequence starts, as a server would)."""
    rows_per_step = step_rows(workload, 1)
    streams: list[DecodeStream | None] = [None] * len(workload.seqs)
    matchers: list[StopStringMatcher | None] = [None] * len(workload.seqs)
    texts = [""] * len(workload.seqs)
    began = time.process_time()
    for rows in rows_per_step:
        for i, ids, _ in rows:
            stream = streams[i]
            if stream is None:
                stream = streams[i] = DecodeStream(skip_special_tokens=True)
                matchers[i] = StopStringMatcher(STOPS)
            piece = stream.step(tokenizer, ids[0])
            if piece:
                texts[i] += matchers[i].push(piece)[0]
    return time.process_time() - began, [t + m.finish() for t, m in zip(texts, matchers, strict=True)]


def run_bare_loop(pieces: list[bytes], workload: Workload, tokens_per_frame: int) -> tuple[float, list[str]]:
    """The issue's "bare byte-table loop": per frame, per row, its ids' bytes from a list, decoded
    with errors replaced. No stop strings, no protobuf, a character split across frames comes
    out as U+FFFD: a floor for what a Python loop over the ids costs, not a detokenizer."""
    frames = step_rows(workload, tokens_per_frame)
    texts: list[list[str]] = [[] for _ in workload.seqs]
    began = time.process_time()
    for rows in frames:
        for i, ids, _ in rows:
            data = pieces[ids[0]] if len(ids) == 1 else b"".join([pieces[t] for t in ids])
            texts[i].append(data.decode("utf-8", "replace"))
    return time.process_time() - began, ["".join(parts) for parts in texts]


def run_naive(tokenizer: Tokenizer, seqs: list[list[int]]) -> tuple[float, list[str]]:
    """Decode every sequence's whole text again after each token and emit the new tail."""
    texts = [""] * len(seqs)
    began = time.process_time()
    for position in range(max(map(len, seqs))):
        for i, ids in enumerate(seqs):
            if position < len(ids):
                full = tokenizer.decode(ids[:position + 1], skip_special_tokens=True)
                if not full.endswith("\ufffd"):
                    texts[i] = full
    return time.process_time() - began, texts


def frame_costs(decoding: TokenizerDecoding, workload: Workload, repeats: int) -> tuple[float, float, float]:
    """Column path at 1 tok/seq/frame, CPU per frame, each the best over repeats of the median:
    frames where no sequence finishes, frames where some do (not the last), and the last frame."""
    finishing = [any(finished for _, _, finished in rows) for rows in step_rows(workload, 1)]
    best = [float("inf")] * 3
    for _ in range(repeats):
        seconds: list[float] = []
        run_frame_loop(decoding, workload, 1, columns=True, frame_seconds=seconds)
        plain = [t for t, ends in zip(seconds[:-1], finishing[:-1], strict=True) if not ends]
        ending = [t for t, ends in zip(seconds[:-1], finishing[:-1], strict=True) if ends]
        for index, values in enumerate((plain, ending, seconds[-1:])):
            if values:
                best[index] = min(best[index], statistics.median(values))
    return best[0], best[1], best[2]


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The flags both detok benches take: tokenizer, and how many sequences, tokens and frames."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="'default' (SmolLM2) or a model directory")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "tokenwire")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per sequence")
    parser.add_argument("--tokens-per-frame", default="1,4,16", help="comma-separated: tokens per sequence per frame")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--naive-sequences", type=int, default=16, help="sample size for the O(n^2) naive way")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--staggered", action="store_true",
                        help="engine-like traffic: staggered starts and lengths, finishes spread over the run")
    args = parser.parse_args()

    model_dir = resolve_model_dir(args.model, args.cache_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    began = time.perf_counter()
    decoding = TokenizerDecoding(tokenizer)
    build_s = time.perf_counter() - began
    table_only = TokenizerDecoding(tokenizer, use_tiktoken=False)
    ids = corpus_ids(tokenizer)
    if args.staggered:
        start_pieces = token_table_for(decoding.token_bytes[True]).start_pieces
        workload = staggered_workload(ids, [start_pieces[i] is not None for i in ids], args.sequences, args.tokens)
    else:
        seqs = sequences_ids(ids, args.sequences, args.tokens)
        workload = Workload(seqs, [0] * len(seqs))
    expected = [tokenizer.decode(seq, skip_special_tokens=True) for seq in workload.seqs]
    sample = workload.seqs[:args.naive_sequences]
    pieces = [piece or b"" for piece in decoding.token_bytes[True].pieces]  # special ids: no text
    total = workload.num_tokens

    # name -> (tokens, run); every repeat runs each once, in turn, so that all of them see
    # the same load on a shared machine; the best (least CPU) run of each is kept.
    methods: dict[str, tuple[int, Callable[[], tuple[float, list[str]]]]] = {}
    for k in (int(k) for k in args.tokens_per_frame.split(",")):
        for label, dec in (("tiktoken", decoding), ("python table", table_only)):
            methods[f"frame loop, {k} tok/seq/frame, {label}"] = (
                total, lambda d=dec, k=k: run_frame_loop(d, workload, k))
        methods[f"column path, {k} tok/seq/frame, tiktoken"] = (
            total, lambda k=k: run_frame_loop(decoding, workload, k, columns=True))
        if k == 1:  # the only frames the one-id loop takes
            methods["column path, 1 tok/seq/frame, numpy pass"] = (
                total, lambda: run_frame_loop(decoding, workload, 1, columns=True, one_id_loop=False))
        methods[f"bare byte-table loop, {k} tok/seq/frame"] = (total, lambda k=k: run_bare_loop(pieces, workload, k))
    methods["DecodeStream.step per token (+ stops)"] = (total, lambda: run_decode_stream(tokenizer, workload))
    methods[f"naive full re-decode per token ({len(sample)} seqs)"] = (sum(map(len, sample)),
                                                                        lambda: run_naive(tokenizer, sample))
    best: dict[str, float] = {}
    lost_tails = bare_wrong = 0
    for repeat in range(args.repeats):
        for name, (_, run) in methods.items():
            if name.startswith("naive") and repeat:
                continue  # O(n^2) and only there for scale: once is enough
            seconds, texts = run()
            best[name] = min(seconds, best.get(name, seconds))
            if name.startswith(("frame loop", "column path")):
                assert texts == expected, "frame loop output differs from tokenizer.decode"
            elif name.startswith("DecodeStream"):
                # DecodeStream has no flush: a sequence ending inside a character loses its last piece.
                assert all(e.startswith(t) for e, t in zip(expected, texts, strict=True)), "DecodeStream differs"
                lost_tails = sum(e != t for e, t in zip(expected, texts, strict=True))
            elif name.startswith("bare"):
                bare_wrong = max(bare_wrong, sum(e != t for e, t in zip(expected, texts, strict=True)))

    reference = best["DecodeStream.step per token (+ stops)"]
    reference_tokens = methods["DecodeStream.step per token (+ stops)"][0]
    starts = "staggered starts and lengths" if args.staggered else "all started together"
    print(f"SmolLM2 tokenizer, {len(workload.seqs)} sequences ({starts}, {args.sequences} at a time), {total} tokens, "
          f"stops {STOPS!r}; tables built in {build_s:.2f} s; CPU time of this process, best of {args.repeats} "
          "interleaved runs")
    print(f"{'method':<52} {'tokens':>8} {'CPU s':>8} {'tokens/s':>12} {'us/token':>9} {'x DecodeStream':>15} "
          f"{'x bare loop':>12}")
    for name, (num_tokens, _) in methods.items():
        seconds = best[name]
        ratio = (num_tokens / seconds) / (reference_tokens / reference)
        k = name.split(", ")[1].split(" ")[0] if "tok/seq/frame" in name else ""
        bare = f"bare byte-table loop, {k} tok/seq/frame"
        bare_ratio = f"{(num_tokens / seconds) / (methods[bare][0] / best[bare]):>12.2f}" if bare in best else ""
        print(f"{name:<52} {num_tokens:>8} {seconds:>8.4f} {num_tokens / seconds:>12,.0f} "
              f"{1e6 * seconds / num_tokens:>9.2f} {ratio:>15.2f} {bare_ratio:>12}")
    print(f"DecodeStream dropped the unfinished last character of {lost_tails} sequences (it cannot flush); "
          f"the bare loop's text differs from tokenizer.decode in {bare_wrong} of {len(expected)} sequences")
    costs = frame_costs(decoding, workload, args.repeats)
    kinds = ("frames where no sequence finishes", "frames where some do", "the last frame")
    print(f"column path, 1 tok/seq/frame, CPU per frame (median, best of {args.repeats}): " + ", ".join(
        f"{1e6 * cost:.0f} us for {kind}" for cost, kind in zip(costs, kinds, strict=True) if cost != float("inf")))


if __name__ == "__main__":
    main()
