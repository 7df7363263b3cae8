"""Run an ember model over a batch of sequences with the torch_ref backend and a paged KV cache, without the engine.

Each sequence owns a fixed range of blocks (block 0 stays the reserved null block). `step` appends new tokens to
any subset of the sequences and returns their last hidden states' logits or all hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.attention_backends.base import BuilderContext
from ember.attention_backends.common import CommonAttentionMetadata
from ember.attention_backends.op import AttentionLayerState, ForwardContext, forward_context
from ember.attention_backends.torch_ref import TorchRefBackend, TorchRefImpl, TorchRefMetadataBuilder
from ember.models.layers.attention import Attention
from ember.kv_spec import KVCacheGroup, KVCacheSpec


class ModelHarness:
    """Owns one KV cache per attention layer and each sequence's context length."""

    def __init__(self, model: nn.Module, num_seqs: int, max_seq_len: int = 128, block_size: int = 8,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.model, self.block_size, self.device = model, block_size, torch.device(device)
        self.blocks_per_seq = -(-max_seq_len // block_size)
        num_blocks = 1 + num_seqs * self.blocks_per_seq
        attentions = [m for m in model.modules() if isinstance(m, Attention)]
        self.layers = {}
        for attn in attentions:
            o = attn.options
            shape = TorchRefBackend.kv_cache_shape(num_blocks, block_size, o.num_kv_heads, o.head_size)
            if o.kv_sharing_target is None:      # a KV-sharing layer reads its source's cache (made earlier)
                cache = torch.zeros(shape, dtype=dtype, device=self.device)   # [2, num_blocks, block_size, Hkv, D]
            else:
                cache = self.layers[o.kv_sharing_target].kv_cache
            impl = TorchRefImpl(o, sinks=attn.sinks)
            self.layers[attn.layer_name] = AttentionLayerState(impl, cache, 0)
        o = attentions[0].options
        spec = KVCacheSpec(block_size, o.num_kv_heads, o.head_size, dtype, o.sliding_window)
        self.builder = TorchRefMetadataBuilder(BuilderContext(
            group=KVCacheGroup(tuple(self.layers), spec), group_index=0, dtype=dtype, device=self.device,
            max_num_reqs=num_seqs, max_num_tokens=num_seqs * max_seq_len, max_model_len=max_seq_len))
        # sequence i owns blocks 1 + i * blocks_per_seq ...; block 0 is the null block
        self.block_table = (1 + torch.arange(num_seqs * self.blocks_per_seq, dtype=torch.int32)).view(
            num_seqs, self.blocks_per_seq)      # [num_seqs, blocks_per_seq]
        self.context_lens = [0] * num_seqs
        self.max_seq_len = max_seq_len

    def _metadata(self, chunks: list[tuple[int, list[int]]]) -> tuple[CommonAttentionMetadata, torch.Tensor]:
        query_lens = [len(ids) for _, ids in chunks]
        seq_lens = [self.context_lens[s] + n for (s, _), n in zip(chunks, query_lens)]
        if max(seq_lens) > self.max_seq_len:
            raise ValueError(f"sequence length {max(seq_lens)} exceeds the harness's max_seq_len {self.max_seq_len}")
        positions, slots = [], []
        for (seq, ids), seq_len in zip(chunks, seq_lens):
            for pos in range(seq_len - len(ids), seq_len):
                positions.append(pos)
                slots.append(int(self.block_table[seq, pos // self.block_size]) * self.block_size
                             + pos % self.block_size)
        query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        num_tokens = sum(query_lens)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device), seq_lens=seq_lens_t.to(self.device),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_t,
            block_tables=(self.block_table[[s for s, _ in chunks]].to(self.device),),
            slot_mappings=(torch.tensor(slots, dtype=torch.int64, device=self.device),),
            num_reqs=len(chunks), num_actual_tokens=num_tokens, num_reqs_padded=len(chunks),
            num_tokens_padded=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            num_decodes=num_decodes, uniform_decode=num_decodes == len(chunks))
        return common, torch.tensor(positions, dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]], skip_prefill: bool = False) -> torch.Tensor:
        """Append chunks (sequence index, new token ids) and return the hidden states [num_new_tokens, hidden].

        With `skip_prefill` (a model with a KV-sharing tail), that tail runs on each chunk's last token only and
        the hidden states [num_chunks, hidden] of those tokens come back."""
        common, positions = self._metadata(chunks)
        input_ids = torch.tensor([t for _, ids in chunks for t in ids], dtype=torch.int64, device=self.device)
        if skip_prefill:
            last = common.query_start_loc[1:].long() - 1                      # [num_chunks]
            tail = decode_view(common)
            for name, state in self.layers.items():   # the sharing tail attends as one query per sequence
                state.group_index = 1 if state.impl.options.kv_sharing_target is not None else 0
            ctx = ForwardContext(layers=self.layers, attn_metadata=(self.builder.build(common),
                                                                    self.builder.build(tail)))
            with forward_context(ctx):
                hidden = self.model(input_ids, positions, last)
        else:
            for state in self.layers.values():
                state.group_index = 0
            ctx = ForwardContext(layers=self.layers, attn_metadata=(self.builder.build(common),))
            with forward_context(ctx):
                hidden = self.model(input_ids, positions)
        for seq, ids in chunks:
            self.context_lens[seq] += len(ids)
        return hidden

    def last_logits(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """`step`, then the logits [num_chunks, vocab] of each chunk's last token."""
        hidden = self.step(chunks)
        last = torch.tensor([len(ids) for _, ids in chunks]).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])


def decode_view(common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """The same sequences with only their last token as the query (what a prefill-skipping tail attends with)."""
    import dataclasses

    num_reqs = common.num_reqs
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    return dataclasses.replace(
        common, query_start_loc=qsl.to(common.query_start_loc.device), query_start_loc_cpu=qsl,
        slot_mappings=tuple(torch.full((num_reqs,), -1, dtype=torch.int64, device=m.device)
                            for m in common.slot_mappings),
        num_actual_tokens=num_reqs, num_tokens_padded=num_reqs, max_query_len=1, num_decodes=num_reqs,
        uniform_decode=True)


def greedy_generate(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, **harness_kwargs) -> list[list[int]]:
    """Prefill every prompt in one batch, then decode all sequences together one token per step (greedy)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    harness = ModelHarness(model, len(prompts), max_seq_len=longest, **harness_kwargs)
    logits = harness.last_logits(list(enumerate(prompts)))
    outputs = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        next_ids = logits.argmax(-1).tolist()
        for out, tok in zip(outputs, next_ids):
            out.append(tok)
        logits = harness.last_logits([(i, [tok]) for i, tok in enumerate(next_ids)])
    return outputs


# Tiny configs of every supported family: 2 layers, hidden 64, GQA/MQA, tied and untied embeddings.
def tiny_config(family: str, **overrides):
    """A small transformers config of `family` ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
    "qwen3_moe", "mixtral", "gpt_oss")."""
    import transformers

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=None,
                  pad_token_id=0)
    families = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32, "rope_theta": 10000.0})),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, tie_word_embeddings=False)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
            num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=True)),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True)),
        # Gemma 2 and 3: one local layer (window 8, shorter than the longer prompts) and one global; soft caps
        # small enough to bend random scores; a query scale that differs from head_dim
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=3.0, final_logit_softcapping=5.0, tie_word_embeddings=True)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
            final_logit_softcapping=5.0, tie_word_embeddings=True)),
        # MoE: 8 experts, 2 a token; Qwen3-MoE's middle layer dense (mlp_only_layers), Mixtral with a window of 8
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
            tie_word_embeddings=False)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8, tie_word_embeddings=False)),
        # gpt-oss: a window of 8 on the first layer, sinks, biases everywhere, yarn rotary, a swiglu limit that
        # random activations reach; hidden and intermediate sizes in whole MXFP4 blocks of 32
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=1.5, attention_bias=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})),
    }
    config_cls, arch, extra = families[family]
    kwargs = {**common, **extra, **overrides}
    return getattr(transformers, config_cls)(architectures=[arch], **kwargs)


@torch.no_grad()
def random_hf_model(config, seed: int = 0):
    """A transformers model (eager attention, float32) whose every weight, norms and biases included, is random."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    # the default init leaves norms at one and biases at zero: perturb them so that loading them wrongly shows
    for param in model.parameters():
        param.add_(torch.randn_like(param) * 0.05)
    return model


def save_tiny_llama(path) -> str:
    """A 2-layer random Llama (vocab 320, hidden 64, GQA 4/2, untied) saved as an HF folder; returns the path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return str(path)


def tiny_model_step(family: str, dtype, seed: int | None = None):
    """A random tiny model of `family` and one step over it: (model, ids [5], positions, ForwardContext) for two
    requests of 3 and 2 tokens on the torch_ref backend (run the model inside `forward_context(context)`)."""
    from ember.models.loader import random_model
    if seed is not None:
        torch.manual_seed(seed)
    model = random_model(tiny_config(family), dtype)
    harness = ModelHarness(model, 2, dtype=dtype)
    common, positions = harness._metadata([(0, [1, 2, 3]), (1, [4, 5])])
    ids = torch.tensor([1, 2, 3, 4, 5])
    context = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
    return model, ids, positions, context
