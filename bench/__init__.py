"""Benchmarks: the OpenAI load generator, the engine-alone driver and the side-by-side comparison.

A package so the pieces import each other (`python -m bench.loadgen`); see bench/README.md.
"""
