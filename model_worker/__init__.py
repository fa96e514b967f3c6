"""tokenwire model worker: runs the model with continuous batching behind a gRPC stream.

Parts: config -> model_files (what to load) -> model_runner (forward + KV cache) ->
scheduler/sampler -> engine (one step) -> servicer (the Generate stream).
"""
