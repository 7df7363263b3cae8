"""A word-level tokenizer with a chat template, saved beside a tiny model so that text paths run offline."""

from __future__ import annotations

from pathlib import Path

WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world", "the", "capital", "of", "france",
         "is", "paris", "a", "cat", "dog", "sat", "on", "mat", "and"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def save_tiny_tokenizer(folder: str | Path, vocab_size: int) -> None:
    """Save a tokenizer over `WORDS` (padded with filler words up to `vocab_size`) into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    words = WORDS + [f"w{i}" for i in range(vocab_size - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")    # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
