"""One golden run: a fixed-seed `grpo-fast train` of the tests' tiny model for 3 steps, summarised.

    python scripts/golden_run.py CASE OUT_DIR [CASE OUT_DIR ...]   # each OUT_DIR/summary.json, its path printed

Several cases run one after the other in one process (each seeds itself: the same summaries as a process each),
which saves the tests a process start and vLLM's imports per case.

CASE is one of CASES below (multi_turn and agents_partial train the tiny tool-calling model, tests/agents/tool_model.py). The summary holds the run's metrics.jsonl rows (times and memory left out)
and, per weight tensor of final/, its float64 sum, sum of magnitudes and norm, plus one sha256 over all the weights'
bytes. `tests/golden/test_golden_run.py` compares the summaries with the committed goldens (within the
last bits that differ between CPU kinds); `scripts/golden_compare.sh BASE` runs every case at a base
commit and at the working tree on one machine and compares them bitwise.

Everything here goes through the command line as a user types it, so the same file drives an older
checkout of grpo_fast (run it with that checkout on PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

COMMON = ["--disable_tqdm", "--reward_funcs", "tests.trainer.common:target_fraction", "--num_generations", "4",
          "--per_device_train_batch_size", "8", "--max_prompt_length", "32", "--max_completion_length", "12",
          "--max_tokens_per_microbatch", "256", "--learning_rate", "3e-2", "--max_steps", "3", "--seed", "0",
          "--mixed_precision", "no", "--vllm_dtype", "float32", "--save_steps", "0", "--eval_steps", "0"]
AGENT = ["--tools", "tests.agents.tool_model:add,tests.agents.tool_model:mul", "--reward_funcs",
         "tests.agents.tool_model:right_answer", "--max_prompt_length", "64", "--max_completion_length", "160",
         "--max_tokens_per_microbatch", "2048", "--learning_rate", "1e-3"]
CASES = {
    "hf_beta_mu2": ["--engine", "hf", "--beta", "0.04", "--num_iterations", "2"],
    "vllm": ["--engine", "vllm"],
    "vllm_partial": ["--engine", "vllm", "--max_staleness", "1"],
    "early_exit": ["--engine", "vllm", "--rollout_mode", "early_exit", "--early_exit_points", "3"],
    "multi_answer": ["--engine", "vllm", "--rollout_mode", "multi_answer", "--answers_per_thought", "1",
                     "--max_thought_length", "6"],
    "lora": ["--engine", "vllm", "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--beta", "0.04"],
    # the tiny tool-calling model (tests/agents/tool_model.py) on its scripted prompts
    "multi_turn": ["--engine", "vllm", *AGENT],
    "agents_partial": ["--engine", "vllm", *AGENT, "--max_staleness", "1", "--rollout_overprovision", "1.0"],
}
STOP_IDS = [2, *range(259, 279)]  # 21 of the 320 token ids end a completion (~6.5% a token)
# left out of the comparison: they measure the machine, not the run
UNSTABLE = ("time", "memory", "tokens_per_second", "wall")


def run(case: str, out: str) -> str:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread: bitwise repeatable on one machine
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from grpo_fast.cli import main
    from tests.tiny_model import build_tiny_model

    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "prompts.jsonl")
    if "--tools" in CASES[case]:
        from tests.agents.tool_model import build_tool_model, tool_prompts

        model = build_tool_model(os.path.join(out, "tool_model"))
        rows = tool_prompts(24)
        _tools_return_before_the_next_engine_step()
    else:
        model = build_tiny_model(os.path.join(out, "tiny"))
        with open(os.path.join(model, "generation_config.json")) as f:
            generation = json.load(f)
        generation["eos_token_id"] = STOP_IDS  # completions of many lengths, up to the budget: partial rollouts carry some
        with open(os.path.join(model, "generation_config.json"), "w") as f:
            json.dump(generation, f)
        rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(24)]
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own folder: a rerun starts afresh
    code = main(["train", "--model", model, "--dataset", data, "--output_dir", run_dir, *COMMON, *CASES[case]])
    if code != 0:
        raise SystemExit(f"golden case {case}: grpo-fast train exited {code}")
    path = os.path.join(out, "summary.json")
    with open(path, "w") as f:
        json.dump(summarise(run_dir), f, indent=1, sort_keys=True)
    return path


def _tools_return_before_the_next_engine_step() -> None:
    """A tool call is ready at the first engine step after it started (the tools are instant), so where a turn
    joins the engine's batch depends on the engine's steps alone, not on threads: the run repeats bitwise."""
    import importlib

    for where in ("grpo_fast.agents.tools", "grpo_fast.generation.agents.tools"):  # (before and after a move)
        try:
            calls = importlib.import_module(where).Calls
        except (ImportError, AttributeError):
            continue
        calls.ready = lambda self: self.wait() or True
        return
    raise SystemExit("golden run: no agents' Calls to make instant")


def summarise(run_dir: str) -> dict:
    from safetensors.torch import load_file

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [{k: v for k, v in json.loads(line).items() if not any(u in k for u in UNSTABLE)} for line in f]
    final = os.path.join(run_dir, "final")
    weights = load_file(os.path.join(final, "model.safetensors" if os.path.exists(os.path.join(final, "model.safetensors"))
                                     else "adapter_model.safetensors"))  # (use_peft: final/ holds the adapter)
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(weights[name].contiguous().view(-1).numpy().tobytes())
    return {"rows": rows, "weights_sha256": digest.hexdigest(),
            "weights": {name: [w.sum().item(), w.abs().sum().item(), w.norm().item()]
                        for name, w in sorted((n, t.double()) for n, t in weights.items())}}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.*
    pairs = sys.argv[1:]
    if not pairs or len(pairs) % 2 or any(case not in CASES for case in pairs[::2]):
        raise SystemExit(f"usage: python scripts/golden_run.py {{{','.join(CASES)}}} OUT_DIR [CASE OUT_DIR ...]")
    for case, out in zip(pairs[::2], pairs[1::2], strict=True):
        print(run(case, out), flush=True)
