"""Random prompts of an exact token length, the same for every system a benchmark compares.

Each prompt is a run of random space-prefixed word tokens (" river", " blue"): a byte-level BPE
splits text at spaces before merging, so the decoded text re-encodes to exactly those ids, and a
server that takes text does exactly as much prefill as one that takes the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str


def default_tokenizer_path() -> Path:
    """The tokenizer of tokenwire's default model (SmolLM2), converted and cached like the model worker does."""
    from model_worker.model_files import DEFAULT_MODEL, resolve_model_dir

    return resolve_model_dir(DEFAULT_MODEL, Path.home() / ".cache" / "tokenwire")


def load_tokenizer(path: Path) -> Tokenizer:
    """path: a tokenizer.json or a model directory holding one."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def tokenizer_or_default(path: str) -> Tokenizer:
    """A --tokenizer flag's tokenizer: at path (a tokenizer.json or a model directory holding one),
    or the default model's when it is empty."""
    return load_tokenizer(Path(path) if path else default_tokenizer_path())


def word_token_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Ids of tokens that decode to a space and 2+ ASCII letters and re-encode to themselves."""
    ids = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id])
        word = text[1:]
        if len(text) >= 3 and text[0] == " " and word.isascii() and word.isalpha():
            if tokenizer.encode(text, add_special_tokens=False).ids == [token_id]:
                ids.append(token_id)
    if len(ids) < 100:
        raise ValueError(f"only {len(ids)} space-prefixed word tokens in this vocabulary; "
                         "random prompts need a byte-level BPE tokenizer like SmolLM2's")
    return np.asarray(ids)


def make_prompts(tokenizer: Tokenizer, num_prompts: int, prompt_len: int, seed: int = 0) -> list[Prompt]:
    """num_prompts different prompts of exactly prompt_len tokens (add_special_tokens=False)."""
    if prompt_len < 1 or num_prompts < 0:
        raise ValueError(f"need prompt_len >= 1 and num_prompts >= 0, not {prompt_len}, {num_prompts}")
    vocabulary = word_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(num_prompts):
        ids = rng.choice(vocabulary, size=prompt_len).tolist()
        text = tokenizer.decode(ids)
        reencoded = tokenizer.encode(text, add_special_tokens=False).ids
        if reencoded != ids:  # would mean the tokenizer merges across spaces
            raise ValueError(f"prompt text re-encodes to {len(reencoded)} tokens, not {prompt_len}: {text[:80]!r}")
        prompts.append(Prompt(ids, text))
    return prompts
