"""Tokenizer identity: where a tokenizer lives and the hash that proves it is the same one.

The model worker publishes a TokenizerIdentity; the gateway and every detok replica load
from it and refuse a tokenizer.json whose hash differs from what the worker serves.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from tokenizers import Tokenizer

from tokenwire.v1 import common_pb2

TOKENIZER_JSON = "tokenizer.json"


class TokenizerMismatchError(ValueError):
    pass


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def id_span(tokenizer: Tokenizer) -> int:
    """One past the largest id the tokenizer has (its added tokens included): not its token
    count, which falls short where the ids have a gap."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def num_token_ids(tokenizer_dir: str | Path) -> int:
    """id_span of the tokenizer in tokenizer_dir; 0 where it has no tokenizer.json."""
    path = Path(tokenizer_dir) / TOKENIZER_JSON
    return id_span(Tokenizer.from_file(str(path))) if path.is_file() else 0


def tokenizer_identity(tokenizer_dir: str | Path) -> common_pb2.TokenizerIdentity:
    tokenizer_dir = Path(tokenizer_dir).resolve()
    return common_pb2.TokenizerIdentity(
        path=str(tokenizer_dir), sha256=file_sha256(tokenizer_dir / TOKENIZER_JSON)
    )


def verified_tokenizer_json(identity: common_pb2.TokenizerIdentity) -> Path:
    """identity's tokenizer.json, after checking it hashes to what the model worker serves."""
    tokenizer_json = Path(identity.path) / TOKENIZER_JSON
    if not tokenizer_json.is_file():
        raise TokenizerMismatchError(f"no {TOKENIZER_JSON} in {identity.path}")
    actual = file_sha256(tokenizer_json)
    if identity.sha256 and actual != identity.sha256:
        raise TokenizerMismatchError(f"{tokenizer_json} has sha256 {actual[:12]}…, "
                                     f"the model worker serves {identity.sha256[:12]}…")
    return tokenizer_json


@functools.lru_cache(maxsize=8)
def _load_verified(path: str, sha256: str) -> Tokenizer:
    identity = common_pb2.TokenizerIdentity(path=path, sha256=sha256)
    return Tokenizer.from_file(str(verified_tokenizer_json(identity)))


def load_tokenizer(identity: common_pb2.TokenizerIdentity) -> Tokenizer:
    """The `tokenizers` Tokenizer named by identity, cached per (path, hash)."""
    return _load_verified(identity.path, identity.sha256)
