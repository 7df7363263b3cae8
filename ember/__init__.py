"""ember: a torch.compile-first runner for Hugging Face decoder models, with a paged KV cache and CUDA graphs."""

import os

# torch's CUDA checks (`torch.cuda.is_available`, `device_count`) ask NVML instead of initializing the driver, so
# that this process stays forkable until it uses a GPU: tensor-parallel workers fork from it (`executor.start`)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from ember.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from ember.engine.request import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name):
    # LLM pulls in the engine, models and tokenizer stack; import it only when it is used.
    if name == "LLM":
        from ember.llm import LLM
        return LLM
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
