"""Model architectures the worker runs natively, each reading and writing the slot KV cache."""
