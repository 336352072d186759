import pytest
import torch
import triton.language  # noqa: F401  imported under TRITON_INTERPRET=1 (see tests/models/conftest.py)

from lmkernels.loading import load_preset


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    """Engine tests run the ops' PyTorch references on the CPU (the interpreter path is tests/models')."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(scope="module")
def tiny_model():
    return load_preset("tiny-llama", dtype=torch.float32, seed=0)


def random_prompts(lengths, seed=1, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


class LetterTokenizer:
    """Every id decodes to one letter (id mod 26): the tiny random models' outputs become readable text, so
    stop strings can be tested."""

    chat_template = None
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - ord("a") + 26 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)
