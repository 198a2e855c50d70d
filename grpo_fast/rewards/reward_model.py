"""A reward model as a reward function (TRL's reward models in `reward_funcs`): a sequence-classification
model scores prompt + completion, its first logit is the reward.

The text is built as TRL builds it: for conversational rows the reward tokenizer's chat template over the
prompt's messages and the completion's, else the prompt and completion concatenated; tokenised without
special tokens added, right-padded, in batches, without gradients, on the trainer's device.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_BATCH_SIZE = 32


def is_reward_model_folder(entry) -> bool:
    """Whether a `reward_funcs` entry names a folder with a config.json (resolved after built-in names and
    'module:function' paths)."""
    return isinstance(entry, (str, os.PathLike)) and (Path(entry) / "config.json").is_file()


def check_reward_model_folder(path) -> None:
    """Before any weights load: the folder holds config.json, weights and a tokenizer, and its config is a
    sequence-classification model (a causal LM would get a random head)."""
    import json

    from ..models import check_model_folder

    try:
        check_model_folder(path)
    except ValueError as err:
        raise ValueError(f"reward model {os.fspath(path)!r}: {err}") from None
    config = json.loads((Path(path) / "config.json").read_text())
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"reward model {os.fspath(path)!r}: expected a sequence-classification model "
                         f"(architectures '...ForSequenceClassification'), got {archs}")


class RewardModel:
    """`reward(prompts, completions, **columns) -> list[float]` from a sequence-classification model."""

    def __init__(self, model, tokenizer, name: str, batch_size: int = DEFAULT_BATCH_SIZE):
        self.model, self.tokenizer, self.__name__, self.batch_size = model.eval(), tokenizer, name, batch_size
        if tokenizer.pad_token is None:  # (TRL: the end-of-sequence token pads)
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # the model finds each row's last token by the pad id
            model.config.pad_token_id = tokenizer.pad_token_id
        model.requires_grad_(False)

    @classmethod
    def from_folder(cls, path) -> "RewardModel":
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_folder(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype="float32")
        return cls(model, AutoTokenizer.from_pretrained(path), Path(path).resolve().name)

    @classmethod
    def from_model(cls, model, tokenizer=None) -> "RewardModel":
        """A loaded model (TRL accepts one in reward_funcs); its tokenizer from the folder it came from."""
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
        return cls(model, tokenizer, Path(model.config._name_or_path or type(model).__name__).name)

    def texts(self, prompts, completions) -> list[str]:
        if prompts and isinstance(prompts[0], list):  # conversational: messages, the completion's appended
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions, strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        import torch  # (importing grpo_fast.rewards stays light)

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.model.device != device:
            self.model.to(device)
        texts, rewards = self.texts(prompts, completions), []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   padding_side="right", add_special_tokens=False).to(device)
            with torch.no_grad():
                rewards += self.model(**batch).logits[:, 0].float().tolist()
        return rewards
