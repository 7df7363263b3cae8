"""Incremental detokenization and stop-string matching, per request, on the host."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without decoding the whole list each step.

    Decodes a small window (from `prefix_offset`) twice, before and after the new tokens, and emits the
    difference, holding back text that ends in an incomplete UTF-8 sequence.

    Without stop strings nothing needs the text until an output is built, so tokens wait in `pending` and are
    decoded together, in one window, when the text is read: a batch run decodes each request once, at its end.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids: list[int] = list(prompt_token_ids[-6:])   # a few prompt tokens give the first output context
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.pending: list[int] = []     # tokens added but not decoded yet (only without stop strings)
        self._new_start = 0              # where the text the last emit added begins

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, add_text: bool = True, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if the text now contains one (the text is cut before it, or
        after it with include_stop_str_in_output). `add_text=False` leaves the token's text out (a stop token);
        `check_stop=False` looks for no stop string (min_tokens not reached yet)."""
        if self.tokenizer is None or not add_text:
            return None
        if not self.stop:
            self.pending.append(token_id)
            return None
        if self._emit([token_id], keep=True):
            return self._check_stop(self._new_start) if check_stop else None
        return None

    def _flush(self) -> None:
        """Decode the pending tokens: in one window when that ends on a whole character, else one by one (as
        they came, so that the text equals what adding each at once would have given)."""
        pending, self.pending = self.pending, []
        if len(pending) > 1 and self._emit(pending, keep=False):
            return
        for token_id in pending:
            self._emit([token_id], keep=True)

    def _emit(self, token_ids: list[int], keep: bool) -> bool:
        """Append tokens and emit the text they add; returns whether any was emitted. With `keep=False` tokens
        whose text is not complete yet are taken back off."""
        n = len(self.token_ids)
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._new_start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return True
        if not keep:
            del self.token_ids[n:]
        return False

    def _check_stop(self, new_start: int) -> str | None:
        if not self.stop:
            return None
        # only matches that end in the new text: one that ended earlier, before min_tokens, is never honoured
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, new_start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def output_text(self, finished: bool) -> str:
        """The text to show now. While unfinished, an end that could still grow into a stop string is held back
        (it would be cut if it did), so that the text shown only ever grows."""
        if self.pending:
            self._flush()
        if finished or not self.stop or self.include_stop:
            return self.text
        return self.text[:len(self.text) - self._stop_prefix_len()]

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that is the start of some stop string."""
        text = self.text
        for n in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
