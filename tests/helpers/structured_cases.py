"""What the structured-output engine tests share: a tiny random Llama with a small byte-level BPE tokenizer (garbage
text, a real byte-level vocabulary, fast steps), the grammars its requests follow, and the check that each output
matches its grammar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from tests.helpers.tiny_tokenizer import save_bpe_tokenizer

CHOICES = ["yes", "no", "maybe so"]
REGEX = r"[a-z]{2,6}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
          "required": ["k", "n"], "additionalProperties": False}


def save_bpe_llama(path: Path, tie_word_embeddings: bool) -> Path:
    """A tiny random Llama (float32, vocabulary 512, seed 0) and its byte-level BPE tokenizer saved into `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    save_bpe_tokenizer(path, 512)
    return path


def generate_results(llm, requests) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) of each (prompt token ids, SamplingParams) request."""
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def check_matches(results, requests) -> None:
    """Every constrained output stopped where its grammar ended and matches it; every unconstrained one ran to
    max_tokens."""
    import jsonschema
    for (tokens, text, reason), (_, params) in zip(results, requests):
        so = params.structured_outputs
        if so is None:
            assert reason == "length" and len(tokens) == params.max_tokens
            continue
        assert reason == "stop", text
        if so.kind == "choice":
            assert text in CHOICES, text
        elif so.kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)
