"""Prompt datasets, the bundled small maths set and the CPU demo model (SmolLM2-135M-Instruct).

Importing this package is cheap: torch/transformers load only inside the functions that need them.
"""

from openrlhf_shape.data.demo_model import ensure_demo_model, find_demo_gguf
from openrlhf_shape.data.prompts import (
    PromptBatcher,
    PromptDataConfig,
    PromptDataset,
    PromptItem,
    build_prompt_dataset,
    bundled_math_path,
    load_rows,
)

__all__ = [
    "PromptBatcher",
    "PromptDataConfig",
    "PromptDataset",
    "PromptItem",
    "build_prompt_dataset",
    "bundled_math_path",
    "ensure_demo_model",
    "find_demo_gguf",
    "load_rows",
]
