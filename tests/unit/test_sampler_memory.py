"""The sampler's memory does not grow with the context: the penalties read [N, V] prompt ids and output counts,
counted from the request table a chunk of columns at a time, so a batch of long requests samples in what a batch of
short ones does, and in what the profile run's sampling (every option at once) measured, plus a chunk."""

from __future__ import annotations

import numpy as np
import torch

from ember.runner import sampling_inputs
from ember.runner.request_table import RequestTable
from ember.runner.sampler import Sampler, SamplingMetadata
from ember.runner.step_input import NewRequest, StepInput
from ember.runner.upload import PackedUpload
from ember.runner.warmup import PROFILE_SAMPLING
from tests.helpers.peak_memory import PeakMemory

N, V, BS, OUT = 8, 1000, 16, 10
CHUNK = 4096
CPU = torch.device("cpu")


def _sample_peak(length: int) -> int:
    """The most bytes sampling a batch of N requests of `length` tokens (OUT of them generated, every sampling
    option on) holds at once, from the table's metadata to the sampled tokens."""
    rng = np.random.default_rng(length)
    table = RequestTable(1, BS, N, 4096, V, CPU)
    upload = PackedUpload(64 + table.upload_elements(), CPU)
    new = tuple(NewRequest(f"r{i}", tuple(rng.integers(0, V, length - OUT).tolist()), PROFILE_SAMPLING, i,
                           ((1,) * -(-length // BS),), length - 1, tuple(rng.integers(0, V, OUT).tolist()))
                for i in range(N))
    upload.begin()
    table.apply(StepInput(new_requests=new), upload)
    rows = table.rows_of([n.req_id for n in new])
    ends = np.full(N, length)
    plan = sampling_inputs.plan_sampling(table, rows, ends, upload)
    table.commit(buf := upload.flush())
    logits = torch.randn(N, V)
    with torch.inference_mode(), PeakMemory() as step:
        meta = sampling_inputs.sampling_metadata(table, plan, torch.as_tensor(rows), torch.as_tensor(ends), buf)
        out = Sampler(use_triton=False)(logits, meta)
    assert out.sampled_token_ids.shape == (N,) and out.logprobs.shape == (N, 21)
    assert meta.prompt_mask.shape == meta.output_counts.shape == (N, V)
    return step.peak


def test_a_long_context_samples_in_what_a_short_one_and_the_profile_do(monkeypatch):
    monkeypatch.setattr(sampling_inputs, "COUNT_CHUNK_ELEMENTS", CHUNK)
    short, long = _sample_peak(400), _sample_peak(4000)
    # a chunk's positions, ids and ones (8 + 8 + 4 bytes an element, and a mask): gathering whole rows of 4,000
    # tokens took 8 x 4,000 x 24 bytes more than rows of 400
    chunk_bytes = CHUNK * 21
    assert long <= short + chunk_bytes, (short, long)
    with torch.inference_mode(), PeakMemory() as profile:
        meta = SamplingMetadata.build([PROFILE_SAMPLING] * N, [0] * N, [[]] * N, [[0]] * N, [()] * N, V, CPU)
        Sampler(use_triton=False)(torch.randn(N, V), meta)
    assert long <= profile.peak + chunk_bytes, (profile.peak, long)
