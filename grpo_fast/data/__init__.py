"""Prompt data: datasets from files or built-in tasks, chat-template encoding."""

from .datasets import check_rows, encode_prompts, load_dataset_rows, prompt_to_text
from .tasks import BUILTIN_TASKS, arithmetic_rows

__all__ = [
    "BUILTIN_TASKS",
    "arithmetic_rows",
    "check_rows",
    "encode_prompts",
    "load_dataset_rows",
    "prompt_to_text",
]
