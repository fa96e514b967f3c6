"""tokenwire model worker: runs the model with continuous batching behind a gRPC stream.

Parts: config -> model_files (what to load) -> model_runner (forward + KV cache) ->
scheduler/sampler -> engine (one step) -> servicer (the Generate stream).
"""

import os as _os

# tokenwire's __init__ chooses gRPC's socket layer (tokenwire/grpc_io.py): grpc-core reads the
# choice once, on import, so it comes before anything in this package imports grpc.
import tokenwire  # noqa: F401

# torch's CPU GEMMs run oneDNN primitives, cached per input shape twice over: by ideep
# (LRU_CACHE_CAPACITY) and by oneDNN itself (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 entries
# each by default. An entry holds 0.6 MB and up (16 MB for 2,000 rows of a 4096-wide layer),
# and ragged steps give almost every step a new row count, so both caches kept filling for the
# whole of a long run. Engine alone, SmolLM2 bf16, 32 streams of mixed prompts for 136 s
# (scratch run): RSS climbed 913 -> 1736 MiB with the defaults and stayed at 993-1010 MiB with
# these bounds, at the same tok/s within noise. 64 entries keep many steps' shapes (the Llama
# family runs 5 distinct GEMMs a step), so a steady decode batch still hits; a miss costs
# ~0.5 ms of primitive creation. torch reads both variables once, when it loads, so they are
# set here, before anything in this package imports torch; values in the environment win
# (0 crashes torch's matmul, so do not use it).
ONEDNN_SHAPE_CACHE_CAPACITY = "64"
for _variable in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    _os.environ.setdefault(_variable, ONEDNN_SHAPE_CACHE_CAPACITY)
