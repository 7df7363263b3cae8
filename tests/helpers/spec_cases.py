"""What the speculative-decoding tests share: the tiny random Llama they run (float32, CPU), its noisy twin (a draft
that agrees with it about half the time), a word-level tokenizer for stop strings, the prompts, the generation
helper, and the bookkeeping that shows steps launched while the step before them was still unread."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.model_harness import random_hf_model, tiny_config

# repetitive prompts: the model's greedy continuation of a loop tends to loop, so proposals get accepted
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8], [200],
           list(range(10, 40)) * 2, [50, 60, 50, 60, 50]]
LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)
WORDS = [f"w{i}" for i in range(LLAMA["vocab_size"])]


def save_llama(path: Path, seed: int = 0, **overrides) -> str:
    """The tiny random Llama (`LLAMA`, with `overrides`) saved into `path`; returns the folder."""
    random_hf_model(tiny_config("llama", **{**LLAMA, **overrides}), seed=seed).save_pretrained(path)
    return str(path)


def save_noisy_llama(path: Path, spread: float = 0.05) -> str:
    """`save_llama`'s model with noise of `spread` of each layer weight's spread added: as a draft it agrees with the
    target about half the time."""
    model = random_hf_model(tiny_config("llama", **LLAMA), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "layers" in name:
                w.add_(torch.randn(w.shape, generator=g) * w.std() * spread)
    model.save_pretrained(path)
    return str(path)


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer (one word of `WORDS` per id) into `path`, so that stop strings can be tested without a
    converted vocabulary; its decoder joins words with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")        # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "unk_token": "w0"}))


def draft_config(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def generate_tokens(llm, prompts, params) -> list[list[int]]:
    """Each prompt's output token ids."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def record_launches(runner, monkeypatch) -> list[str]:
    """From now on, "launch" for every step `runner` launches and "wait" for every step result read on the host."""
    from ember.runner.output import AsyncModelRunnerOutput
    from ember.spec_decode.verify import VerifyOutput
    events = []
    launch = runner.execute_async
    monkeypatch.setattr(runner, "execute_async", lambda step: events.append("launch") or launch(step))
    for cls in (VerifyOutput, AsyncModelRunnerOutput):
        monkeypatch.setattr(cls, "result", lambda h, r=cls.result: events.append("wait") or r(h))
    return events


def num_overlapped(events: list[str]) -> int:
    """How many launches of `record_launches`' events came while a step before them was still unread."""
    unread, overlapped = 0, 0
    for e in events:
        overlapped += e == "launch" and unread > 0
        unread += 1 if e == "launch" else -1
    return overlapped


def streamed_run(engine, prompt, params) -> tuple[list[int], list[int]]:
    """Stream one request through `engine`: its output tokens, and the indices of those that arrived after another
    token of their own step (inside an accepted run)."""
    rid = engine.add_request(prompt, params)
    seen, inside, tokens = 0, [], []
    while engine.has_unfinished():
        for out in engine.step(stream=True):
            if out.request_id == rid:
                tokens = out.outputs[0].token_ids
                inside += list(range(seen + 1, len(tokens)))      # arrived after another token of its step
                seen = len(tokens)
    return tokens, inside


def greedy(max_tokens: int, **options):
    """Greedy decoding of exactly `max_tokens` tokens (ignore_eos), with further `SamplingParams` options."""
    from ember import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def check_stop_token_and_max_tokens(llm, reference, stop_index: int, lengths) -> None:
    """On `llm` (speculating), a stop token taken from `reference[0][stop_index]` ends the output at its first
    occurrence and nothing after it; `max_tokens` n of `lengths` gives the first n tokens of the first two prompts.
    `reference` holds the plain greedy outputs of `PROMPTS`."""
    ref = reference[0]
    stop = ref[stop_index]
    params = greedy(len(ref), stop_token_ids=[stop])
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    for n in lengths:
        assert generate_tokens(llm, PROMPTS[:2], greedy(n)) == [r[:n] for r in reference[:2]]


def check_stop_string_inside_an_accepted_run(llm, reference) -> None:
    """On `llm` (speculating, with `save_word_tokenizer`'s tokenizer), a stop string that first occurs inside an
    accepted run ends the output right after it, its text included."""
    tokens, inside = streamed_run(llm.engine, PROMPTS[0], greedy(len(reference[0])))
    assert tokens == reference[0] and inside
    words = llm.tokenizer.decode(tokens).split(" ")
    i = next(i for i in inside if words.index(words[i]) == i)       # a word first seen inside an accepted run
    params = greedy(len(tokens), stop=[" " + words[i]], include_stop_str_in_output=True)
    got = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert got.finish_reason == "stop" and got.token_ids == tokens[:i + 1]
    assert got.text.split() == words[:i + 1] and got.text.endswith(" " + words[i])
