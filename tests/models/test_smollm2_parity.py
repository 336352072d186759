"""SmolLM2-135M-Instruct from the embedded GGUF against Hugging Face transformers on the same file."""

import pytest
import torch

from lmkernels.loading import load_model, load_tokenizer, smollm2_gguf_path
from lmkernels.models import greedy_generate, prefill_logits

from .conftest import rel_err

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # HF loads GGUF files only with accelerate installed


def _gguf():
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_smollm2_gguf_matches_hf(reference_ops):
    from transformers import AutoModelForCausalLM

    path = _gguf()
    model = load_model(path, dtype=torch.float32)
    tok = load_tokenizer(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"

    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    assert len(ids) > 20

    # last-position logits of a real chat-templated prompt, fp32
    ours = prefill_logits(model, [ids])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    assert torch.isfinite(ours).all()
    assert rel_err(ours, ref) < 1e-4

    # 32 greedy tokens: our paged decode against HF generate (EOS off on both sides, so all 32 count; the
    # attention mask is explicit: HF would otherwise mask the prompt's <|im_end|>, which is its pad token)
    new = greedy_generate(model, [ids], 32)[0]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    assert new == gen[0, len(ids):].tolist()
    assert len(new) == 32

    # a packed batch (another prompt of another length beside it) gives each prompt's logits alone
    other = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                    add_generation_prompt=True, tokenize=True)
    other = list(other["input_ids"] if not isinstance(other, list) else other)
    both = prefill_logits(model, [other, ids])
    assert rel_err(both[1], ours) < 1e-5
    answer = greedy_generate(model, [other], 8, eos_token_ids=[tok.eos_token_id])[0]
    assert "Paris" in tok.decode(answer)
