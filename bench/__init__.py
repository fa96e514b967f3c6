"""Benchmarks: the OpenAI load generator, the engine-alone driver and the side-by-side comparison.

A package so the pieces import each other (`python -m bench.loadgen`); see bench/README.md.
"""

from tokenwire.grpc_io import use_poll_io as _use_poll_io

_use_poll_io()  # before anything in this package imports grpc: grpc-core reads the choice once, on import
