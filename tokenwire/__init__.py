"""tokenwire: code shared by the model worker, the detokenizer and the gateway.

Holds the generated wire contract (tokenwire.v1), byte packing, tokenizer identity and
the gRPC server plumbing; each service package imports it, never each other.
"""
