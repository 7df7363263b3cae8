"""Memory roofline for decoding: bytes a step must read (weights once, plus every active sequence's KV cache)
over the device's measured copy bandwidth, and the device measurements it needs (copy bandwidth, matmul rate).

A decode step is memory-bound: whatever the kernels do, the step cannot finish before every weight and every
cached K/V it attends to has crossed the memory bus once. The figures here are that floor, so "% of roofline"
says how close a measured step or run comes to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


# ---- what a step reads ------------------------------------------------------------------------------------------
def kv_bytes_per_token(hf_config, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of K and V one token keeps across all layers on one GPU: 2 x layers x kv_heads x head_dim x dtype size,
    kv_heads being one rank's (a head replicated where there are fewer than ranks)."""
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    num_kv_heads = max(1, num_kv_heads // tensor_parallel_size)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * int(hf_config.num_hidden_layers) * num_kv_heads * head_dim * element


def decode_weight_bytes(model: nn.Module, hf_config, tokens_per_step: int | None = None) -> int:
    """Bytes of weights one step reads (on one GPU: a tensor-parallel rank's shard): every distinct parameter once,
    in its stored dtype (fp8 weights at one byte, their float32 scales at four), less the input embedding table when
    it is not tied to the LM head (a step gathers only its own rows of it). With `tokens_per_step`, a
    mixture-of-experts layer counts only the experts that many tokens choose: exactly top_k at one token, and for B
    tokens the expected number of distinct experts under uniform routing, E * (1 - (1 - top_k / E) ** B)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())   # parameters() drops tied duplicates
    if not getattr(hf_config, "tie_word_embeddings", False):
        embedding = next((m.weight for m in model.modules() if type(m).__name__ == "VocabEmbedding"), None)
        if embedding is not None:
            total -= embedding.numel() * embedding.element_size()
        else:
            total -= int(hf_config.vocab_size) * int(hf_config.hidden_size) * next(model.parameters()).element_size()
    if tokens_per_step is not None:
        total -= sum(all_bytes - touched for all_bytes, touched in expert_bytes(model, tokens_per_step))
    return total


def expert_bytes(model: nn.Module, tokens_per_step: int) -> list[tuple[int, int]]:
    """Per mixture-of-experts layer: (bytes of all its experts, bytes of the experts `tokens_per_step` tokens are
    expected to read), as `decode_weight_bytes` counts them; [] for a dense model."""
    layers = [m for m in model.modules() if hasattr(m, "expected_experts") and hasattr(m, "experts")]
    out = []
    for layer in layers:
        all_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
        share = layer.expected_experts(tokens_per_step) / layer.experts.num_experts
        out.append((all_bytes, round(all_bytes * share)))
    return out


def context_tokens_read(prompt_len: int, output_len: int) -> int:
    """KV tokens read over one request's life: the step producing output token k (k = 1..O) attends to P + k - 1
    cached tokens (k = 1 is the prefill), so the sum is O*P + O*(O-1)/2."""
    return output_len * prompt_len + output_len * (output_len - 1) // 2


# ---- device measurements ----------------------------------------------------------------------------------------
def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 512 << 20, iters: int = 20) -> float | None:
    """Device-memory bandwidth in bytes/s from timed device-to-device copies (a copy reads and writes each byte);
    None off CUDA, where there is no comparable figure."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)   # [nbytes], far larger than any L2
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def measure_matmul_rate(device: torch.device | str, dtype: torch.dtype = torch.bfloat16, n: int = 8192,
                        iters: int = 10) -> float | None:
    """Dense matmul rate in FLOP/s on square n x n operands; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, dtype=dtype, device=device)   # [n, n]
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        torch.mm(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 * iters / seconds


def device_sync(device: torch.device | str) -> None:
    """Wait for queued device work so that host timers measure it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- rooflines --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    """A run's bytes moved and the floor on its time at the measured bandwidth (None when not measured)."""
    bytes_moved: int
    bandwidth_bytes_s: float | None
    tokens: int                       # the tokens the rate is quoted for (output tokens)
    measured_s: float

    @property
    def time_s(self) -> float | None:
        """The least time the bytes can take at the measured bandwidth."""
        return self.bytes_moved / self.bandwidth_bytes_s if self.bandwidth_bytes_s else None

    @property
    def tok_s(self) -> float | None:
        """The most tokens per second the bandwidth allows."""
        return self.tokens / self.time_s if self.time_s else None

    @property
    def pct(self) -> float | None:
        """Measured rate as a percentage of the roofline rate."""
        return 100.0 * self.time_s / self.measured_s if self.time_s and self.measured_s > 0 else None

    def as_dict(self) -> dict:
        """Every field and derived figure, for JSON."""
        d = asdict(self)
        d.update(time_s=self.time_s, tok_s=self.tok_s, pct=self.pct,
                 bandwidth_gb_s=self.bandwidth_bytes_s / 1e9 if self.bandwidth_bytes_s else None)
        return d

    def describe(self) -> str:
        """One line to print beside a measured rate."""
        if self.tok_s is None:
            return f"roofline n/a (no bandwidth measurement on this device; {self.bytes_moved / 1e9:.2f} GB moved)"
        return (f"roofline {self.tok_s:,.0f} tok/s ({self.bytes_moved / 1e9:.1f} GB at "
                f"{self.bandwidth_bytes_s / 1e9:,.0f} GB/s); achieved {self.pct:.1f}%")


def run_roofline(weight_bytes: int, kv_token_bytes: int, num_steps: int, prompt_lens: list[int],
                 output_lens: list[int], bandwidth: float | None, measured_s: float) -> Roofline:
    """Roofline of a whole run: weights read once per step plus each request's KV reads over its life."""
    kv_tokens = sum(context_tokens_read(p, o) for p, o in zip(prompt_lens, output_lens))
    return Roofline(weight_bytes * num_steps + kv_token_bytes * kv_tokens, bandwidth, sum(output_lens), measured_s)


def step_bytes(weight_bytes: int, kv_token_bytes: int, context_lens: list[int]) -> int:
    """Bytes one step reads: the weights once and the KV of every scheduled sequence's context."""
    return weight_bytes + kv_token_bytes * sum(context_lens)


def decode_roofline(weight_bytes: int, kv_token_bytes: int, batch_size: int, prompt_len: int, output_len: int,
                    bandwidth: float | None, measured_step_s: float) -> Roofline:
    """Roofline of one average decode step of a batch: contexts at their mean length over the generation."""
    mean_context = prompt_len + output_len // 2
    return Roofline(step_bytes(weight_bytes, kv_token_bytes, [mean_context] * batch_size), bandwidth, batch_size,
                    measured_step_s)
