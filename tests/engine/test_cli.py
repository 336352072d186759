"""`lmkernels generate`: user errors are one line on stderr and exit code 2; a real answer from SmolLM2."""

import json

import pytest

from lmkernels.cli import main


def _error(capsys, argv):
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmkernels generate: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_missing_model_file(capsys, tmp_path):
    assert "model not found" in _error(capsys, ["hi", "--model", str(tmp_path / "nope.gguf")])


def test_corrupt_model_files(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(7)) * 3)
    assert "corrupt" in _error(capsys, ["hi", "--model", str(bad)])
    bad.write_bytes(b"not a gguf at all")
    assert "not a GGUF" in _error(capsys, ["hi", "--model", str(bad)])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{broken")
    assert "not valid JSON" in _error(capsys, ["hi", "--model", str(tmp_path / "hf")])


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "vocab_size": 100}))
    assert "unsupported architecture" in _error(capsys, ["hi", "--model", str(tmp_path)])


def test_prompt_errors(capsys, tmp_path):
    assert "empty" in _error(capsys, ["", "--model", "tiny-llama"])
    assert "empty" in _error(capsys, ["   ", "--model", "tiny-llama"])
    assert "give a prompt" in _error(capsys, ["--model", "tiny-llama"])
    assert "context" in _error(capsys, ["x" * 1100, "--model", "tiny-llama"])  # 1024 positions
    assert "cannot read" in _error(capsys, ["--prompts-file", str(tmp_path / "none.txt")])
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert "no prompts" in _error(capsys, ["--prompts-file", str(tmp_path / "blank.txt")])


@pytest.mark.parametrize("flags,match", [
    (["--temperature", "-1"], "temperature"), (["--temperature", "hot"], "--temperature must be a number"),
    (["--top-p", "0"], "top_p"), (["--top-p", "1.5"], "top_p"), (["--top-k", "abc"], "--top-k must be an integer"),
    (["--max-new-tokens", "0"], "max_new_tokens"), (["--seed", "1.5"], "--seed must be an integer"),
])
def test_invalid_sampling_values(capsys, flags, match):
    assert match in _error(capsys, ["hi", "--model", "tiny-llama", *flags])


def test_batch_from_a_prompts_file(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\nsecond, a longer prompt\nthird\n")
    rc = main(["generate", "--model", "tiny-llama", "--prompts-file", str(f), "--max-new-tokens", "4",
               "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--no-cuda-graph"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert sorted(line[:3] for line in lines[:-1]) == ["[0]", "[1]", "[2]"]
    assert "prefill" in lines[-1] and "decode" in lines[-1] and "tokens/s" in lines[-1]


def test_smollm2_knows_the_capital_of_france(capsys):
    from lmkernels.loading import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rc = main(["generate", "What is the capital of France?", "--max-new-tokens", "20"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    answer, stats = out.strip().splitlines()[0], out.strip().splitlines()[-1]
    assert "Paris" in answer
    assert "prefill" in stats and "decode" in stats and "tokens/s" in stats


def test_missing_package(capsys, monkeypatch, tmp_path):
    import sys

    from lmkernels.loading import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the [hf] extra were not installed
    assert "pip install 'lmkernels[hf]'" in _error(capsys, ["hi"])
