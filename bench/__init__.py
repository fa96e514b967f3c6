"""Benchmarks: the OpenAI load generator, the engine-alone driver and the side-by-side comparison.

A package so the pieces import each other (`python -m bench.loadgen`); see bench/README.md.
"""

# tokenwire's __init__ chooses gRPC's socket layer (tokenwire/grpc_io.py): grpc-core reads the
# choice once, on import, so it comes before anything in this package imports grpc.
import tokenwire  # noqa: F401
