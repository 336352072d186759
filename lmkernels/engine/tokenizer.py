"""Tokenizer helpers: a byte-level stand-in for models without a tokenizer (random-weight presets), chat
templating, and incremental detokenization for streaming."""

from typing import List


class ByteTokenizer:
    """UTF-8 bytes as token ids 3 … 258 (0, 1, 2: pad, bos, eos); other ids decode to nothing. It lets the
    random-weight presets take text (for benchmarks and tests); their output is noise."""

    chat_template = None
    offset = 3

    def __init__(self, vocab_size: int = 259, bos_token_id=None, eos_token_id=None):
        if vocab_size < 259:
            raise ValueError(f"a byte tokenizer needs a vocabulary of ≥ 259 tokens, the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        if add_special_tokens and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


def encode_prompt(tokenizer, prompt: str, raw: bool = False) -> List[int]:
    """Token ids of a text prompt: through the chat template (a user turn + the generation prompt) when the
    tokenizer has one and not raw; else plain encoding (with the tokenizer's BOS)."""
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


class Detokenizer:
    """Text deltas of a growing list of token ids. Decodes a short window (the previous token or so as
    context, so word-initial spaces survive), and holds a delta back while it ends in an incomplete UTF-8
    character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = 0
        self.read_offset = 0

    def step(self, ids: List[int]) -> str:
        dec = self.tokenizer.decode
        prefix = dec(ids[self.prefix_offset: self.read_offset], skip_special_tokens=True)
        new = dec(ids[self.prefix_offset:], skip_special_tokens=True)
        if len(new) > len(prefix) and not new.endswith("\ufffd") and new.startswith(prefix):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return new[len(prefix):]
        if not new.startswith(prefix):  # a tokenizer that re-merges across the window: resync on the full text
            full_prev = dec(ids[: self.read_offset], skip_special_tokens=True)
            full = dec(ids, skip_special_tokens=True)
            if not full.endswith("\ufffd") and full.startswith(full_prev):
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
                return full[len(full_prev):]
        return ""

    def flush(self, ids: List[int], text_so_far: str) -> str:
        """What is left at the end (an incomplete character is emitted as decoded)."""
        full = self.tokenizer.decode(ids, skip_special_tokens=True)
        return full[len(text_so_far):] if full.startswith(text_so_far) else ""
