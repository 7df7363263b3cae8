"""The sampler and the per-step sampling metadata it reads."""

from ember.runner.sampler.metadata import SamplingMetadata
from ember.runner.sampler.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
