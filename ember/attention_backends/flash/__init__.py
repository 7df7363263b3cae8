"""FlashAttention-style backend: separate prefill and balanced split-KV decode kernels (Triton)."""
