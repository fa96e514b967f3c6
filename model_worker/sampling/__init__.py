"""The batched sampler: per-request SamplingParams in, one token per row out, all rows at once.

The engine builds a Sampler; each step it hands over the logits of the rows that need a token
and the Sequences they belong to. Parts: params validation, counter-based random draws, token
penalty state kept on the device, pure logits processors, and the Sampler that chains them.
"""

from model_worker.sampling.sampler import Sampler, SamplerOutput
from model_worker.sampling.validation import validate_sampling_params

__all__ = ["Sampler", "SamplerOutput", "validate_sampling_params"]
