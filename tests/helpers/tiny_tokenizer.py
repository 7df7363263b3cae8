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


# text the byte-level BPE tokenizer learns its merges from: words, digits and JSON punctuation
BPE_CORPUS = ["hello world the capital of france is paris a cat and a dog sat on the mat yes no maybe so",
              '{"k": "a", "n": 12} {"name": "Ann", "age": 42} [1, 2, 3] true false null',
              "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ -_.,:;!?()[]{}"] * 4


def save_bpe_tokenizer(folder: str | Path, vocab_size: int) -> None:
    """Save a byte-level BPE tokenizer of `vocab_size` tokens (every byte, then merges learnt from `BPE_CORPUS`, then
    filler tokens), with "</s>" as EOS and the tiny chat template, into `folder`: a real byte-level vocabulary, as
    grammar engines need, small enough that tests sample fast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(BPE_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
