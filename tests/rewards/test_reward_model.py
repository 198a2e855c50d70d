"""Reward models in reward_funcs (TRL's): a folder of a sequence-classification model, or a loaded one,
scores prompt + completion as a plain forward of that model does, whatever the batch and padding; bad
folders are refused before any weights load; the trainer trains on its scores."""

import os
import shutil

import pytest
import torch

from grpo_fast.rewards import get_reward_funcs
from grpo_fast.rewards.reward_model import RewardModel
from tests.helpers import assert_close, scaled
from tests.tiny_model import build_tiny_tokenizer, tiny_llama_config

PROMPTS = ["question 1: ", "a much longer question, number 2: ", "3"]
COMPLETIONS = ["yes", "the answer is forty-two, surely", ""]
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    from transformers import LlamaForSequenceClassification

    path = tmp_path_factory.mktemp("tiny_rm") / "tiny-rm"
    torch.manual_seed(0)
    LlamaForSequenceClassification(tiny_llama_config(num_labels=1)).float().save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def _plain(folder, texts):
    """The test's own forward: one text at a time, no padding, no special tokens added, logits[0, 0]."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tok = AutoModelForSequenceClassification.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def _close(a, b):
    assert_close(a, b, atol=scaled(1e-5, b), name="reward model scores")


def test_a_folder_scores_as_a_plain_forward_whatever_the_batch(reward_folder):
    (rm,) = get_reward_funcs([reward_folder])
    assert isinstance(rm, RewardModel) and rm.__name__ == "tiny-rm", "named in metrics by the folder's base name"
    want = _plain(reward_folder, [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    assert len(set(want)) == 3, "the texts score differently (else the comparison shows nothing)"
    _close(rm(PROMPTS, COMPLETIONS), want)  # one batch, right-padded to the longest
    rm.batch_size = 1
    _close(rm(PROMPTS, COMPLETIONS), want)
    rm.batch_size = 2
    _close(rm(PROMPTS[::-1], COMPLETIONS[::-1]), want[::-1])


def test_conversational_rows_go_through_the_reward_tokenizers_chat_template(reward_folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_folder)
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(CHATS, completions, strict=True)]
    assert texts[0].startswith("<s>user\nquestion 1: </s>\n<s>assistant\nyes")
    model = AutoModelForSequenceClassification.from_pretrained(reward_folder)
    (rm,) = get_reward_funcs([model])  # a loaded model, as TRL accepts (its tokenizer from its folder)
    assert rm.__name__ == "tiny-rm"
    _close(rm(CHATS, completions), _plain(reward_folder, texts))


def test_bad_reward_model_folders_are_refused_before_loading(reward_folder, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the folder was checked"))
    no_weights = shutil.copytree(reward_folder, tmp_path / "no-weights")
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(ValueError, match=r"reward model '.*no-weights': .*missing weights"):
        get_reward_funcs([str(no_weights)])
    causal = shutil.copytree(reward_folder, tmp_path / "causal")
    config = (causal / "config.json").read_text().replace("LlamaForSequenceClassification", "LlamaForCausalLM")
    (causal / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"expected a sequence-classification model .*got \['LlamaForCausalLM'\]"):
        get_reward_funcs([str(causal)])
    with pytest.raises(ValueError, match=r"unknown reward '.*nothing-here'.*or a reward model folder"):
        get_reward_funcs([str(tmp_path / "nothing-here")])


def test_the_trainer_trains_on_a_reward_models_scores(reward_folder, tmp_path, tiny):
    from grpo_fast.trainer import GRPOTrainer
    from tests.trainer.common import config, rows

    c = config(tmp_path, reward_funcs=[reward_folder], max_steps=1, eval_before_train=False, save_final=False,
               report_to="none")
    funcs = get_reward_funcs(list(c.reward_funcs))  # as the CLI resolves them
    trainer = GRPOTrainer(c, funcs, rows(), model=tiny[0], tokenizer=tiny[1])
    last = trainer.train()
    assert "rewards/tiny-rm/mean" in last and last["grad_norm"] > 0, last
