"""Model architectures: native ones (llama.py, gpt2.py) read and write the paged KV cache
through attention.py; hf_fallback.py runs any other transformers causal LM, slower."""
