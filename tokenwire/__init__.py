"""tokenwire: code shared by the model worker, the detokenizer and the gateway.

Holds the generated wire contract (tokenwire.v1), byte packing, tokenizer identity and
the gRPC server plumbing; each service package imports it, never each other.
"""

from tokenwire.grpc_io import use_poll_io as _use_poll_io

# Before any tokenwire module imports grpc (`python -m tokenwire.stack` runs this first): grpc-core
# reads the choice once, on import. The service packages import tokenwire first for the same reason.
_use_poll_io()
