"""tokenwire's detok worker: a gRPC service turning streams of token ids into UTF-8 text deltas.

Sits between the model worker's token frames and the gateway's streamed text; flow:
token_bytes -> incremental -> stop_strings, per sequence in sequence.py, per stream in
stream.py, served by servicer.py; render.py spells token ids for logprobs beside that flow.
"""

# tokenwire's __init__ chooses gRPC's socket layer (tokenwire/grpc_io.py): grpc-core reads the
# choice once, on import, so it comes before anything in this package imports grpc.
import tokenwire  # noqa: F401
