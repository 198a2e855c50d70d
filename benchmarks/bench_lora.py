"""LoRA in the native trainer against full fine-tuning: step time and weight sync, memory without an engine,
held-out accuracy. Three parts, each under an hour on the 2-core CPU, each its own results file:

    python benchmarks/bench_lora.py --part b        # routes: benchmarks/results/lora_cpu_b.{json,md}
    python benchmarks/bench_lora.py --part memory   # memory:  benchmarks/results/lora_cpu_memory.{json,md}
    python benchmarks/bench_lora.py --part a        # accuracy (long; resumable): lora_cpu_a.{json,md}

b (routes): SmolLM2-135M-Instruct, the default task, a small batch (4 prompts x 8 completions, up to 64 new
   tokens, eval off), 3 steps per column (the first a warm-up, the others averaged). Columns: full fine-tuning
   and LoRA (merged and adapter sync routes) on the vLLM engine, LoRA and full on the HF engine, and TRL's
   GRPOTrainer with a PEFT LoRA of the same shape (r 16, alpha 32, all-linear; transformers generation, as TRL
   runs on this CPU). Step time and its parts from metrics.jsonl (TRL: a callback and wrapped methods), sync
   seconds (time/weight_sync), sync bytes from the tensors each route hands the engine, peak RSS per process.
memory: one generation batch of the default run (8 prompts x 8 completions) is recorded once from a real
   step; then each column, in a process that never imports an engine, builds the policy, the reference,
   the optimizer and the stages the trainer builds (trainer.py) and runs 2 optimizer steps through
   grpo_fast's own stages (logprobs.side_inputs for the reference, step.optimizer_step) on that batch.
   Peak RSS above the RSS after imports, full fine-tuning against LoRA at beta 0 and 0.04, beside the
   model state computed from tensor sizes (weights, gradients, AdamW state, reference).
a (accuracy): full fine-tuning and LoRA (r 16, all-linear, lora_sync auto), seeds 42 and 1, 20 steps of the
   default run's settings (8 prompts x 8 completions, eval every 5 steps on 200 held-out prompts). LoRA at
   learning rate 1e-4, 10x full's default 1e-5. Resumable: a column whose result exists is kept (--force), and a
   column stopped part-way (its --timeout-min, a kill) continues from its last checkpoint (every 5 steps).

Every column runs in its own process (harness.run_children): a fresh engine, its own peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
PARTS = ("time/generate", "time/reward", "time/logprob", "time/train", "time/weight_sync", "time/sync_check")

# part b: name -> (trainer, engine, use_peft, lora_sync)
B_COLUMNS = {
    "full_vllm": ("grpo_fast", "vllm", False, "auto"),
    "lora_merged_vllm": ("grpo_fast", "vllm", True, "merged"),
    "lora_adapter_vllm": ("grpo_fast", "vllm", True, "adapter"),
    "lora_hf": ("grpo_fast", "hf", True, "auto"),
    "full_hf": ("grpo_fast", "hf", False, "auto"),
    "trl_lora": ("trl", "hf", True, None),
}
# part memory: name -> (use_peft, beta, max_tokens_per_microbatch (None: the CPU default, 1024), gradient
# checkpointing). The _tok320 pair (the smallest budget the default max_prompt_length 256 + 64 allows) and the _gc
# pairs (gradient checkpointing, TRL's GRPOConfig default) show how much of the peak is the micro-batch's
# activations, about the same for both
MEM_COLUMNS = {"full_beta0": (False, 0.0, None, False), "lora_beta0": (True, 0.0, None, False),
               "full_beta0.04": (False, 0.04, None, False), "lora_beta0.04": (True, 0.04, None, False),
               "full_beta0_tok320": (False, 0.0, 320, False), "lora_beta0_tok320": (True, 0.0, 320, False),
               "full_beta0_gc": (False, 0.0, None, True), "lora_beta0_gc": (True, 0.0, None, True),
               "full_beta0.04_gc": (False, 0.04, None, True), "lora_beta0.04_gc": (True, 0.04, None, True)}
FULL_LR, LORA_LR = 1e-5, 1e-4
LORA = dict(lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=["all-linear"])
GiB, MiB = 2**30, 2**20
LOAD_NOTE = ("load start / end: the 1-minute load average as each column began and ended; a column alone keeps it near 2 "
             "(both cores busy), above that other work shared the 2 cores and its times are noisy")


def a_columns(seeds) -> dict:
    """part a: name -> (use_peft, seed), full and LoRA side by side per seed."""
    return {f"{kind}_s{seed}": (kind == "lora", seed) for seed in seeds for kind in ("full", "lora")}


def _peak_rss() -> dict:
    """The process's peak RSS (ru_maxrss) and that of its largest waited-for child, in bytes; the load average
    at its start (LOAD_START) and now: how busy the shared CPU was while it ran."""
    import resource

    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "load_average_start": LOAD_START, "load_average_end": harness.load_average()}


LOAD_START = harness.load_average()


def _numel_bytes(tensors, dtype=None) -> int:
    """Bytes of the tensors, each in `dtype` when given (the engine's), else in its own."""
    import torch

    size = None if dtype is None else torch.tensor([], dtype=dtype).element_size()
    return sum(t.numel() * (size or t.element_size()) for t in tensors)


def sync_bytes(model, engine_dtype) -> dict:
    """What each route hands the engine after a step, from the tensors themselves: full = every weight in the
    engine's dtype (a tied embedding once); merged = the targeted layers' weights in the engine's dtype;
    adapter = the A / B tensors as handed over (their own dtype)."""
    from grpo_fast.models import lora

    if not lora.is_lora(model):
        return {"full": _numel_bytes(list(model.parameters()), engine_dtype)}
    return {"full": _numel_bytes([t for _, t in lora.engine_weights(model, merged=False)], engine_dtype),
            "merged": _numel_bytes([t for _, t in lora.engine_weights(model, merged=True, only_adapted=True)], engine_dtype),
            "adapter": _numel_bytes(list(lora.adapter_tensors(model).values()))}


# ------------------------------------------------------------------------------------------------
# part b: routes
# ------------------------------------------------------------------------------------------------


def child_b(name: str, args) -> dict:
    trainer, engine, use_peft, lora_sync = B_COLUMNS[name]
    return _b_trl(args) if trainer == "trl" else _b_grpo_fast(name, engine, use_peft, lora_sync, args)


def _b_grpo_fast(name, engine, use_peft, lora_sync, args) -> dict:
    from grpo_fast.config import GRPOConfig
    from grpo_fast.trainer import GRPOTrainer

    out = Path(args.workdir) / "b" / name
    lora = LORA if use_peft else {}
    c = GRPOConfig(engine=engine, use_peft=use_peft, lora_sync=lora_sync, **lora,
                   learning_rate=LORA_LR if use_peft else FULL_LR, num_generations=args.n,
                   per_device_train_batch_size=args.prompts * args.n, max_completion_length=args.max_new_tokens,
                   max_steps=args.steps, output_dir=str(out), overwrite_output_dir=True, disable_tqdm=True,
                   save_final=False, eval_before_train=False, eval_steps=0, report_to="none", task_train_size=200)
    start = time.perf_counter()
    t = GRPOTrainer.from_config(c)
    build = time.perf_counter() - start
    t.train()
    records = [json.loads(line) for line in open(out / "metrics.jsonl") if '"step_time"' in line]
    timed = records[1:] or records
    mean = lambda key: sum(r.get(key) or 0.0 for r in timed) / len(timed)  # noqa: E731
    shares = t.engine_shares_weights
    engine_dtype = None if shares else t.engine.dtype
    candidates = sync_bytes(t.model, engine_dtype) if engine_dtype is not None else {}
    route = None if shares else (c.lora_route or "full")
    trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
    return {"trainer": "grpo_fast", "engine": type(t.engine).__name__, "route": route or "none (shares the policy)",
            "engine_dtype": str(engine_dtype).replace("torch.", "") if engine_dtype else None,
            "precision": t.precision_summary(), "build_s": build, "steps_timed": len(timed),
            "step_time_s": mean("step_time"), "parts_s": {p: mean(p) for p in PARTS},
            "per_step_time_s": [r["step_time"] for r in records],
            "sync_bytes": candidates.get(route, 0) if route else 0, "sync_bytes_candidates": candidates,
            "trainable_params": trainable, "reward": mean("reward"),
            "mean_completion_length": mean("completions/mean_length"),
            "sync_check_diff": mean("sampling/sync_check_diff") if not shares else None, **_peak_rss()}


def _b_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from grpo_fast import models
    from grpo_fast.data.tasks import task_rows
    from grpo_fast.rewards import get_reward_funcs

    path = models.resolve_model_path("default")
    rows = task_rows("arithmetic:200", split="train", seed=42)  # the default task's prompts, as chat messages
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    steps: list[dict] = []  # one dict of seconds per optimizer step

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            steps.append({"start": time.perf_counter(), "generate": 0.0, "reward": 0.0, "generate_and_score": 0.0})

        def on_step_end(self, *a, **k):
            steps[-1]["step"] = time.perf_counter() - steps[-1]["start"]

    def timed(obj, method: str, key: str) -> None:
        inner = getattr(obj, method)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if steps:
                    steps[-1][key] += time.perf_counter() - start

        setattr(obj, method, wrapper)

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    micro = min(8, args.prompts * args.n)  # micro-batches of 8 accumulated over the step (bench_step.py)
    peft_config = LoraConfig(r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], lora_dropout=LORA["lora_dropout"],
                             target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
    errors = {}
    for bf16 in (True, False):  # TRL's default (bf16 autocast, as grpo_fast's on this CPU), else fp32
        try:
            config = TRLConfig(
                output_dir=str(Path(args.workdir) / "b" / "trl_lora"), per_device_train_batch_size=micro,
                gradient_accumulation_steps=args.prompts * args.n // micro, num_generations=args.n,
                max_completion_length=args.max_new_tokens, max_steps=args.steps, learning_rate=LORA_LR, beta=0.0,
                gradient_checkpointing=False, bf16=bf16, logging_steps=1, save_strategy="no", report_to="none",
                temperature=1.0, seed=42, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
                disable_tqdm=True)
            start = time.perf_counter()
            t = TRLTrainer(model=path, reward_funcs=get_reward_funcs(["math"]), args=config,
                           train_dataset=Dataset.from_list(rows), processing_class=tokenizer, peft_config=peft_config,
                           callbacks=[StepTimer()])
            build = time.perf_counter() - start
            timed(t, "_generate", "generate")
            timed(t, "_calculate_rewards", "reward")
            timed(t, "_generate_and_score_completions", "generate_and_score")
            t.train()
            break
        except Exception as err:  # noqa: BLE001 - the report says which configuration ran
            if not bf16:
                raise
            errors["bf16=True"] = f"{type(err).__name__}: {err}"[-400:]
            steps.clear()
    logs = [h for h in t.state.log_history if "completions/mean_length" in h]
    timed_steps, logged = steps[1:] or steps, logs[1:] or logs
    mean = lambda key: sum(s[key] for s in timed_steps) / len(timed_steps)  # noqa: E731
    parts = {"time/generate": mean("generate"), "time/reward": mean("reward"),
             "time/logprob": mean("generate_and_score") - mean("generate") - mean("reward"),  # the rest of TRL's batch prep
             "time/train": mean("step") - mean("generate_and_score"), "time/weight_sync": 0.0, "time/sync_check": 0.0}
    trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
    return {"trainer": "trl", "trl_version": harness.package_version("trl"), "engine": "transformers generate",
            "route": "none (generates with the policy)", "engine_dtype": None, "bf16": bf16, "failed_configs": errors,
            "build_s": build, "steps_timed": len(timed_steps), "step_time_s": mean("step"), "parts_s": parts,
            "per_step_time_s": [s["step"] for s in steps], "sync_bytes": 0, "sync_bytes_candidates": {},
            "trainable_params": trainable,
            "reward": sum(h.get("reward", 0.0) for h in logged) / max(len(logged), 1),
            "mean_completion_length": sum(h["completions/mean_length"] for h in logged) / max(len(logged), 1),
            "sync_check_diff": None, **_peak_rss()}


def _load_cell(r: dict) -> str:
    """The 1-minute load average as the column's process began and ended."""
    return f"{r['load_average_start'][0]:.1f} / {r['load_average_end'][0]:.1f}" if "load_average_start" in r else "-"


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def markdown_b(report: dict) -> str:
    cols = report["columns"]
    lines = ["# LoRA sync routes vs full fine-tuning: one GRPO step (CPU)", "", f"Command: `{report['command']}`", "",
             f"{report['setup']}.", "", f"Machine: {report['machine']}. Single runs, 2 timed steps each (the best step is the least "
             f"disturbed); {LOAD_NOTE}.", "",
             "| column | engine | sync route | step (s) | best step | generate | reward | logprob | train | sync | sync check "
             "| sync bytes | peak RSS | mean length | trainable params | load start / end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in cols.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][-300:]!r} |")
            continue
        p = r["parts_s"]
        best = min(r["per_step_time_s"][1:] or r["per_step_time_s"])
        lines.append(f"| {name} | {r['engine']} | {r['route']} | {r['step_time_s']:.2f} | {best:.2f} | "
                     + " | ".join(f"{p[k]:.2f}" for k in PARTS)
                     + f" | {_fmt_bytes(r['sync_bytes'])} | {_fmt_bytes(r['peak_rss_bytes'])} "
                       f"| {r['mean_completion_length']:.0f} | {r['trainable_params'] / 1e6:.2f}M | {_load_cell(r)} |")
    lines += ["", "Parts: generate (sampling), reward, logprob (no-grad passes; for TRL: the rest of its batch "
              "preparation), train (forward/backward/optimizer), sync (time/weight_sync), sync check (the probe after "
              "a sync). Sync bytes: full = every engine weight in the engine's dtype; merged = the targeted layers' "
              "weights (W_base + s·B·A) in the engine's dtype; adapter = the A/B tensors as handed to vLLM (fp32 "
              "here). The HF engine and TRL generate with the policy itself: nothing to sync. Peak RSS: the child "
              "process's ru_maxrss (vLLM runs in-process, so it counts the engine)."]
    ratios = report.get("ratios", {})
    if ratios:
        lines += ["", "## Ratios", "", "| ratio | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.3f} |" for k, v in ratios.items()]
    cand = next((r["sync_bytes_candidates"] for r in cols.values() if len(r.get("sync_bytes_candidates", {})) == 3), None)
    if cand:
        lines += ["", f"Computed sync bytes of this model per route (engine dtype bfloat16): full {_fmt_bytes(cand['full'])}, "
                  f"merged {_fmt_bytes(cand['merged'])} ({cand['merged'] / cand['full']:.3f}x), adapter "
                  f"{_fmt_bytes(cand['adapter'])} ({cand['adapter'] / cand['full']:.4f}x). SmolLM2's tied 49152x576 "
                  "embedding is 21% of its weights and never adapted, so merged saves that much; on a 7B model "
                  "(below) the decoder's linear layers are 96% of the weights."]
    trl = cols.get("trl_lora", {})
    if trl.get("failed_configs"):
        lines += ["", "TRL configurations that failed here: " + "; ".join(f"{k}: {v}" for k, v in trl["failed_configs"].items())]
    if "bf16" in trl:
        lines += ["", f"TRL ran with bf16={trl['bf16']} (its default on this CPU: fp32 weights under bf16 autocast, as "
                  f"grpo_fast's mixed_precision=auto here), beta 0, dapo, gradient checkpointing off, micro-batches of 8 "
                  f"accumulated over the 32 completions, TRL {trl.get('trl_version')}."]
    lines += ["", model_7b_markdown()]
    return "\n".join(lines) + "\n"


def ratios_b(cols: dict) -> dict:
    ok = lambda n: n in cols and "error" not in cols[n]  # noqa: E731
    out = {}
    if ok("full_vllm"):
        full = cols["full_vllm"]
        for name in ("lora_merged_vllm", "lora_adapter_vllm"):
            if ok(name):
                r = cols[name]
                out[f"step time {name} / full_vllm"] = r["step_time_s"] / full["step_time_s"]
                out[f"sync seconds {name} / full_vllm"] = (r["parts_s"]["time/weight_sync"]
                                                           / max(full["parts_s"]["time/weight_sync"], 1e-9))
                out[f"sync bytes {name} / full_vllm"] = r["sync_bytes"] / full["sync_bytes"]
                out[f"peak RSS {name} / full_vllm"] = r["peak_rss_bytes"] / full["peak_rss_bytes"]
    if ok("full_hf") and ok("lora_hf"):
        out["step time lora_hf / full_hf"] = cols["lora_hf"]["step_time_s"] / cols["full_hf"]["step_time_s"]
        out["peak RSS lora_hf / full_hf"] = cols["lora_hf"]["peak_rss_bytes"] / cols["full_hf"]["peak_rss_bytes"]
    if ok("trl_lora"):
        for name in ("lora_hf", "lora_merged_vllm"):
            if ok(name):
                out[f"step time {name} / trl_lora"] = cols[name]["step_time_s"] / cols["trl_lora"]["step_time_s"]
    return out


# ------------------------------------------------------------------------------------------------
# part memory: training without an engine
# ------------------------------------------------------------------------------------------------


def child_record(args) -> dict:
    """One generation batch of the default run (8 prompts x 8 completions, vLLM), captured from a real step."""
    from grpo_fast.config import GRPOConfig
    from grpo_fast.train import generate
    from grpo_fast.trainer import GRPOTrainer

    captured = []
    inner = generate.generation_batch

    def capture(*a, **k):
        out = inner(*a, **k)
        captured.append(out.batch)
        return out

    generate.generation_batch = capture
    out = Path(args.workdir) / "memory" / "record"
    c = GRPOConfig(max_steps=1, output_dir=str(out), overwrite_output_dir=True, disable_tqdm=True, save_final=False,
                   eval_before_train=False, eval_steps=0, report_to="none")
    GRPOTrainer.from_config(c).train()
    b = captured[0]
    data = {"prompt_ids": b.prompt_ids, "completion_ids": b.completion_ids,
            "sampling_logp": [x.tolist() for x in b.sampling_logp], "finish_reason": b.finish_reason,
            "completion_texts": b.completion_texts, "rows": b.rows, "rewards": b.rewards.tolist()}
    Path(args.rollouts).write_text(json.dumps(data) + "\n")
    lengths = [len(x) for x in b.completion_ids]
    return {"completions": len(lengths), "mean_completion_length": sum(lengths) / len(lengths),
            "max_completion_length": max(lengths), "mean_prompt_length": sum(map(len, b.prompt_ids)) / len(lengths),
            "reward_mean": float(b.rewards.nanmean())}


def child_memory(name: str, args) -> dict:
    use_peft, beta, budget, checkpointing = MEM_COLUMNS[name]
    # every import first (torch, transformers' Llama, peft, grpo_fast's stages and ops): the baseline
    import peft  # noqa: F401
    import peft.tuners.lora  # noqa: F401
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401

    from grpo_fast import distributed, ops  # noqa: F401
    from grpo_fast.config import GRPOConfig
    from grpo_fast.generation.batch import Rollouts
    from grpo_fast.generation.engines.base import SamplingOptions
    from grpo_fast.generation.modes import rollout_mode
    from grpo_fast.models import lora
    from grpo_fast.models.policy import (
        ContextBudget,
        Policy,
        PolicyOptions,
        prepare_policy,
        reference_copy,
        reference_of,
    )
    from grpo_fast.models.precision import Precision
    from grpo_fast.objective import LossOptions
    from grpo_fast.rewards import get_reward_funcs  # noqa: F401
    from grpo_fast.train import advantages, logprobs, step
    from grpo_fast.train.advantages import AdvantageOptions
    from grpo_fast.train.forward import Packer
    from grpo_fast.train.optimizer import OptimizerOptions, build_optimizer, build_scheduler
    from grpo_fast.train.state import TrainState
    from grpo_fast.trainer import Options

    recorded = json.loads(Path(args.rollouts).read_text())
    harness.release_memory()
    rss_imports = harness.rss_bytes()

    def reset_hwm() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    hwm = lambda: harness._status_bytes("VmHWM")  # noqa: E731
    reset_hwm()
    start = time.perf_counter()
    c = GRPOConfig(use_peft=use_peft, **(LORA if use_peft else {}), beta=beta,
                   learning_rate=LORA_LR if use_peft else FULL_LR, max_steps=args.mem_steps, report_to="none",
                   max_tokens_per_microbatch=budget, gradient_checkpointing=checkpointing, output_dir=str(Path(args.workdir) / "memory" / name))
    # what GRPOTrainer.__init__ builds, less the engine (trainer.py): policy, reference, packer, optimizer, stages
    precisions = Precision.from_config(c)
    budget = ContextBudget(c.max_prompt_length, c.max_sequence_completion,
                           rollout_mode(c.rollout_mode).sequence_text(c, longest=True), c.eval_max_completion_length,
                           c.vllm_max_model_length)
    model, tokenizer, path = prepare_policy(PolicyOptions.from_config(c), precisions, budget, c)
    ref_model = reference_copy(model, c.beta)
    world = distributed.ONE_PROCESS
    packer = Packer(model, c.token_budget(cuda=False), amp_dtype=precisions.amp_dtype(False))
    options = Options(LossOptions.from_config(c), AdvantageOptions.from_config(c), SamplingOptions.from_config(c))
    parallel = distributed.parallelize(model, world, c.distributed_strategy)
    reference = reference_of(model, ref_model, world, parallel, c.beta)
    policy = Policy(model, tokenizer, path, packer, parallel, reference, None)  # no engine: no sync route
    optimizer = build_optimizer(model, OptimizerOptions.from_config(c))
    scheduler = build_scheduler(optimizer, OptimizerOptions.from_config(c))
    state = TrainState(global_batch=c.completions_per_step)
    # no engine's log-probs to correct for (as the HF engine: the trainer samples itself), one update per batch
    is_policy = logprobs.ISPolicy(shares_weights=True, use_is=False, in_step=False, needs_old_logp=False,
                                  mode=c.is_mode, cap=c.vllm_importance_sampling_cap,
                                  clip_min=c.vllm_importance_sampling_clip_min)
    build_s = time.perf_counter() - start
    rss_built, hwm_build = harness.rss_bytes(), hwm()

    class Bar:
        def print(self, *a, **k):
            print(*a, **k, flush=True)

    per_step = []
    reset_hwm()
    for _ in range(args.mem_steps):
        t0 = time.perf_counter()
        batch = Rollouts(prompt_ids=recorded["prompt_ids"], completion_ids=recorded["completion_ids"],
                         sampling_logp=[torch.tensor(x, dtype=torch.float32) for x in recorded["sampling_logp"]],
                         finish_reason=recorded["finish_reason"], completion_texts=recorded["completion_texts"],
                         rows=recorded["rows"], rewards=torch.tensor(recorded["rewards"], dtype=torch.float64))
        adv, _ = advantages.advantages(batch, options.advantages, None, prompt_column=c.prompt_column, world=world)
        batch.advantages = adv
        side = logprobs.side_inputs(batch, policy, is_policy, temperature=c.temperature, backend=c.loss_backend,
                                    check=False)
        batch = side.into(batch)
        t1 = time.perf_counter()
        steps = step.StepOptions.from_config(c, group_size=c.group_size)
        num_items = step.items_per_step(batch, steps, options.loss, world)
        for part in step.step_slices(batch, steps, state.step):
            metrics = step.optimizer_step(part, num_items, Bar(), policy, optimizer, scheduler, steps=steps,
                                          options=options.loss, state=state, world=world)
        per_step.append({"logprob_s": t1 - t0, "train_s": time.perf_counter() - t1, "rss_after": harness.rss_bytes(),
                         "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                         "kl": metrics.get("kl")})
    hwm_steps = hwm()
    # model state from the tensors themselves
    base = model.get_base_model() if lora.is_lora(model) else model
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen_or_base = [p for n, p in base.named_parameters() if ".lora_" not in n]
    adam = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)
    parts = {"weights": _numel_bytes(frozen_or_base),
             "adapter": _numel_bytes([p for n, p in base.named_parameters() if ".lora_" in n]),
             "gradients": _numel_bytes(trainable), "adamw_state": 2 * sum(p.numel() for p in trainable) * 4,
             "adamw_state_measured": adam,
             "reference": _numel_bytes(list(ref_model.parameters())) if ref_model is not None else 0}
    parts["model_state"] = sum(parts[k] for k in ("weights", "adapter", "gradients", "adamw_state", "reference"))
    peak = max(hwm_build, hwm_steps)
    return {"use_peft": use_peft, "beta": beta, "token_budget": c.token_budget(cuda=False),
            "gradient_checkpointing": checkpointing, "precision": f"weights {next(model.parameters()).dtype}, autocast {packer.amp_dtype}",
            "engine_imported": "vllm" in sys.modules, "rss_after_imports": rss_imports, "rss_after_build": rss_built,
            "peak_build": hwm_build, "peak_steps": hwm_steps, "peak_above_imports": peak - rss_imports,
            "peak_steps_above_imports": hwm_steps - rss_imports, "build_s": build_s, "per_step": per_step,
            "trainable_params": sum(p.numel() for p in trainable), "state_bytes": parts,
            "completions": len(recorded["completion_ids"]),
            "completion_tokens": sum(map(len, recorded["completion_ids"])), **_peak_rss()}


def markdown_memory(report: dict) -> str:
    cols, rec = report["columns"], report.get("record", {})
    lines = ["# Memory of training without an engine: full fine-tuning vs LoRA (CPU)", "",
             f"Command: `{report['command']}`", "", f"Machine: {report['machine']} ({LOAD_NOTE}; memory does not depend on it).", "",
             f"Setup: SmolLM2-135M-Instruct (float32 weights, bf16 autocast on this CPU, as the trainer picks here). "
             f"One generation batch of the default run, recorded once from a real step (vLLM, seed 42): "
             f"{rec.get('completions', '?')} completions, mean completion length "
             f"{rec.get('mean_completion_length', float('nan')):.1f} (max {rec.get('max_completion_length', '?')}), "
             f"mean prompt length {rec.get('mean_prompt_length', float('nan')):.1f}. Each column in its own process "
             "builds what GRPOTrainer.__init__ builds except the engine (models.policy.prepare_policy, reference_copy / "
             "reference_of, Packer, build_optimizer, Options) and runs "
             f"{report['mem_steps']} optimizer steps on that batch through grpo_fast's stages "
             "(advantages.advantages, logprobs.side_inputs for the reference log-probs, step.optimizer_step). vLLM is "
             "never imported (checked). Peak = VmHWM (peak RSS) above the RSS after every import; it includes "
             "activations and allocator slack, and the checkpoint's pages while it loads (the weights are memory-mapped "
             "and mostly paged in by the first forward, so they show in the steps' peak). Peak - model state: what "
             "is neither weights, gradients, AdamW state nor reference: the micro-batch's activations (saved for "
             "backward, with their bf16 autocast copies), autocast's bf16 weight cache, the loss's chunks, allocator "
             "slack.", "",
             "## Measured", "",
             "| column | micro-batch tokens | grad. checkpointing | trainable params | RSS after imports | peak above imports | of which steps "
             "| peak - model state | build peak above imports | RSS after build | logprob + train s/step | loss step 2 "
             "| load start / end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in cols.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][-300:]!r} |")
            continue
        train = sum(s["train_s"] + s["logprob_s"] for s in r["per_step"][1:] or r["per_step"]) / max(len(r["per_step"][1:] or r["per_step"]), 1)
        lines.append(f"| {name} | {r.get('token_budget', 1024)} | {'yes' if r.get('gradient_checkpointing') else 'no'} "
                     f"| {r['trainable_params'] / 1e6:.2f}M | {_fmt_bytes(r['rss_after_imports'])} "
                     f"| **{_fmt_bytes(r['peak_above_imports'])}** | {_fmt_bytes(r['peak_steps_above_imports'])} "
                     f"| {_fmt_bytes(r['peak_above_imports'] - r['state_bytes']['model_state'])} "
                     f"| {_fmt_bytes(r['peak_build'] - r['rss_after_imports'])} | {_fmt_bytes(r['rss_after_build'])} "
                     f"| {train:.1f} | {r['per_step'][-1]['loss']:.4g} | {_load_cell(r)} |")
    lines += ["", "## Model state from tensor sizes", "",
              "| column | weights (fp32) | adapter | gradients | AdamW state (2x fp32 of trainable) | reference | **model state** "
              "| AdamW state as held |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in cols.items():
        if "error" in r:
            continue
        s = r["state_bytes"]
        lines.append(f"| {name} | {_fmt_bytes(s['weights'])} | {_fmt_bytes(s['adapter'])} | {_fmt_bytes(s['gradients'])} "
                     f"| {_fmt_bytes(s['adamw_state'])} | {_fmt_bytes(s['reference'])} | **{_fmt_bytes(s['model_state'])}** "
                     f"| {_fmt_bytes(s['adamw_state_measured'])} |")
    targets = report.get("targets", [])
    if targets:
        lines += ["", "## Targets (LoRA / full)", "", "| quantity | beta | full | LoRA | ratio | target | met |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {t['what']} | {t['beta']} | {_fmt_bytes(t.get('full_bytes'))} | {_fmt_bytes(t.get('lora_bytes'))} "
                  f"| {t['ratio']:.3f} | <= {t['target']} | {'yes' if t['met'] else '**no**'} |" for t in targets]
        common = [(n, r["peak_above_imports"] - r["state_bytes"]["model_state"]) for n, r in cols.items()
                  if "state_bytes" in r and r.get("token_budget", 1024) == 1024 and not r.get("gradient_checkpointing")]
        if common:
            lo, hi = min(b for _, b in common), max(b for _, b in common)
            lines += ["", f"What the measured peaks miss by: besides the model state, every column holds "
                      f"{_fmt_bytes(lo)} to {_fmt_bytes(hi)} at the default 1024-token micro-batch (peak - model state "
                      "above), LoRA about as much as full fine-tuning: the micro-batch's activations and what goes with "
                      "them do not shrink with the trainable parameters. On a 135M-parameter model that is as large as "
                      "full fine-tuning's whole model state, so the ratio of peaks stays near 0.6 whatever LoRA saves. "
                      "Smaller micro-batches (the 320-token pair) and gradient checkpointing (the _gc pairs: each "
                      "decoder layer's activations recomputed in backward, TRL's GRPOConfig default) bring it toward the "
                      "model-state ratio; on a 7B model "
                      "(below) the model state is tens of GB against a few GB of activations per micro-batch, so the "
                      "ratio there is expected near the model-state one (not measured). The peaks carry a few hundred "
                      "MiB of allocator noise (single runs; the glibc heap keeps freed blocks)."]
    lines += ["", model_7b_markdown()]
    return "\n".join(lines) + "\n"


def targets_memory(cols: dict) -> list[dict]:
    """LoRA / full against the targets; the 320-token pair is shown against beta 0's targets too (not a target
    of its own: it shows what the activations of the default 1024-token micro-batch do to the ratio)."""
    out = []
    for suffix, beta, state_target, peak_target in (("0", 0.0, 0.3, 0.6), ("0.04", 0.04, 0.25, 0.5),
                                                   ("0_tok320", 0.0, 0.3, 0.6), ("0_gc", 0.0, 0.3, 0.6),
                                                   ("0.04_gc", 0.04, 0.25, 0.5)):
        full, lora_ = cols.get(f"full_beta{suffix}", {}), cols.get(f"lora_beta{suffix}", {})
        if "state_bytes" not in full or "state_bytes" not in lora_:
            continue
        tag = {"tok320": " (320-token micro-batches)", "gc": " (gradient checkpointing)"}.get(suffix.rpartition("_")[2], "")
        for what, key, target in (("model state", None, state_target), ("measured peak above imports", "peak_above_imports", peak_target)):
            ratio = (lora_["state_bytes"]["model_state"] / full["state_bytes"]["model_state"] if key is None
                     else lora_[key] / full[key])
            out.append({"what": what + tag, "beta": beta, "ratio": ratio, "target": target, "met": ratio <= target,
                        "full_bytes": full["state_bytes"]["model_state"] if key is None else full[key],
                        "lora_bytes": lora_["state_bytes"]["model_state"] if key is None else lora_[key]})
    return out


# ------------------------------------------------------------------------------------------------
# The 7B model (computed)
# ------------------------------------------------------------------------------------------------


def model_7b(hidden=4096, intermediate=11008, layers=32, vocab=32000, kv_heads=32, heads=32, r=16) -> dict:
    """Bytes of a Llama-2-7B-shaped model (untied embeddings, MHA) trained on one GPU: bf16 weights, full fine-tuning
    with bf16 gradients and fp32 AdamW m, v; LoRA r on every decoder linear layer, the adapter in fp32 (PEFT keeps
    adapters of a bf16 base in fp32), its gradients and AdamW state fp32. Sync: bf16 engine."""
    kv = hidden * kv_heads // heads
    linear = {"q": (hidden, hidden), "k": (hidden, kv), "v": (hidden, kv), "o": (hidden, hidden),
              "gate": (hidden, intermediate), "up": (hidden, intermediate), "down": (intermediate, hidden)}
    per_layer = sum(i * o for i, o in linear.values())
    decoder_linear = layers * per_layer
    total = decoder_linear + 2 * vocab * hidden + layers * 2 * hidden + hidden
    lora_params = layers * sum(r * (i + o) for i, o in linear.values())
    bf16, fp32 = 2, 4
    full = {"weights": total * bf16, "trainable params": total, "gradients": total * bf16,
            "AdamW state": 2 * total * fp32, "reference (beta > 0)": total * bf16, "sync bytes": total * bf16}
    lora_ = {"weights": total * bf16 + lora_params * fp32, "trainable params": lora_params,
             "gradients": lora_params * fp32, "AdamW state": 2 * lora_params * fp32, "reference (beta > 0)": 0,
             "sync bytes (merged)": decoder_linear * bf16, "sync bytes (adapter)": lora_params * fp32}
    for d in (full, lora_):
        d["model state, beta 0"] = d["weights"] + d["gradients"] + d["AdamW state"]
        d["model state, beta > 0"] = d["model state, beta 0"] + d["reference (beta > 0)"]
    return {"shape": dict(hidden=hidden, intermediate=intermediate, layers=layers, vocab=vocab, heads=heads,
                          kv_heads=kv_heads, lora_r=r), "params": total, "decoder_linear_params": decoder_linear,
            "full": full, "lora": lora_}


def model_7b_markdown() -> str:
    m = model_7b()
    f, lo = m["full"], m["lora"]
    g = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    rows = [("weights (bf16; LoRA: + adapter fp32)", f["weights"], lo["weights"]),
            ("gradients (full bf16, LoRA fp32)", f["gradients"], lo["gradients"]),
            ("AdamW state (m, v fp32)", f["AdamW state"], lo["AdamW state"]),
            ("reference model (beta > 0)", f["reference (beta > 0)"], lo["reference (beta > 0)"]),
            ("**model state, beta 0**", f["model state, beta 0"], lo["model state, beta 0"]),
            ("**model state, beta > 0**", f["model state, beta > 0"], lo["model state, beta > 0"]),
            ("sync bytes per step: full / merged (bf16)", f["sync bytes"], lo["sync bytes (merged)"]),
            ("sync bytes per step: full / adapter (fp32 A, B)", f["sync bytes"], lo["sync bytes (adapter)"])]
    lines = ["## A model, not a measurement: the same for a 7B model on one GPU", "",
             f"Llama-2-7B-like shapes (hidden 4096, intermediate 11008, 32 layers, vocab 32000, untied lm_head, 32 "
             f"KV heads): {m['params'] / 1e9:.3f}B parameters, {m['decoder_linear_params'] / 1e9:.3f}B of them in the "
             f"decoder's linear layers; LoRA r=16 all-linear: {lo['trainable params'] / 1e6:.1f}M trainable. Computed "
             "from the shapes; activations, the engine's KV cache and allocator overhead are left out. Full: bf16 weights "
             "and gradients, AdamW m and v in fp32 (torch.optim.AdamW on bf16 weights, grpo_fast's CUDA default, "
             "keeps them in bf16: half of this). GB = 1e9 bytes.", "",
             "| | full fine-tuning | LoRA r=16 | LoRA / full |", "| --- | --- | --- | --- |"]
    for what, a, b in rows:
        lines.append(f"| {what} | {g(a)} | {g(b)} | {b / a:.4f} |" if a else f"| {what} | {g(a)} | {g(b)} | - |")
    lines.append("")
    lines.append(f"On an 80 GB GPU full fine-tuning's model state alone ({g(f['model state, beta 0'])} at beta 0) does not "
                 f"fit, before activations and the engine; LoRA's ({g(lo['model state, beta 0'])}, the same with a "
                 "reference: the adapter is switched off instead of a copy) leaves most of the GPU to the engine. Merged "
                 "sync rewrites every targeted layer, so on a 7B model it moves 96% of the bytes a full sync moves (the "
                 "embeddings and lm_head are all it skips); the adapter route moves 1.2%.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# part a: accuracy
# ------------------------------------------------------------------------------------------------


def child_a(name: str, args) -> dict:
    from grpo_fast.config import GRPOConfig
    from grpo_fast.run.checkpoint import list_checkpoints
    from grpo_fast.trainer import GRPOTrainer

    use_peft, seed = a_columns(args.seeds)[name]
    out = Path(args.workdir) / "a" / name
    # a checkpoint every save_steps: a column stopped by its timeout (or anything else) continues from its last
    # checkpoint when the part is run again (grpo_fast resumes exactly at a round's end)
    saved = list_checkpoints(str(out))
    resumed_from = int(Path(saved[-1]).name.rsplit("-", 1)[-1]) if saved else 0
    c = GRPOConfig(seed=seed, use_peft=use_peft, **(LORA if use_peft else {}), max_steps=args.a_steps,
                   learning_rate=args.lora_lr if use_peft else FULL_LR, output_dir=str(out),
                   overwrite_output_dir=not saved, resume_from_checkpoint="latest" if saved else None,
                   save_steps=args.save_steps, save_total_limit=1, disable_tqdm=True, save_final=False,
                   report_to="none")
    start = time.perf_counter()
    t = GRPOTrainer.from_config(c)
    t.train()
    wall = time.perf_counter() - start
    by_step = {}  # (kind, step) -> the last row written (a resumed run rewrites the steps after its checkpoint)
    for line in open(out / "metrics.jsonl"):
        r = json.loads(line)
        by_step[("eval" if "eval/accuracy" in r else "train", r["step"])] = r
    evals = sorted((step, r["eval/accuracy"]) for (kind, step), r in by_step.items() if kind == "eval")
    steps = [r for (kind, _), r in sorted(by_step.items(), key=lambda x: x[0][1]) if kind == "train" and "step_time" in r]
    return {"use_peft": use_peft, "seed": seed, "learning_rate": c.learning_rate, "route": c.lora_route or "full",
            "engine": type(t.engine).__name__, "wall_s": wall, "resumed_from_step": resumed_from, "eval_history": evals,
            "accuracy_before": evals[0][1] if evals and evals[0][0] == 0 else None,
            "accuracy_after": evals[-1][1] if evals else None,
            "train_reward": [r.get("reward") for r in steps],
            "step_time_s": sum(r["step_time"] for r in steps) / max(len(steps), 1),
            "time_weight_sync_s": sum(r.get("time/weight_sync", 0.0) for r in steps) / max(len(steps), 1),
            "trainable_params": sum(p.numel() for p in t.model.parameters() if p.requires_grad), **_peak_rss()}


def markdown_a(report: dict) -> str:
    cols = report["columns"]
    lines = ["# Held-out accuracy: full fine-tuning vs LoRA (CPU)", "", f"Command: `{report['command']}`", "",
             f"{report['setup']}.", "", f"Machine: {report['machine']} ({LOAD_NOTE}; the accuracies do not depend on it).", "",
             "Why LoRA gets 1e-4 (10x full's 1e-5): a rank-16 update starts at zero (B = 0) and is scaled by "
             "alpha/r = 2; at full fine-tuning's rate it moves the policy far less per step. The common practice is a "
             "learning rate about 10x the full-fine-tuning one (Thinking Machines, \"LoRA Without Regret\", 2025: "
             "the optimal LoRA rate is ~10x the full one across their runs).", "",
             "| run | lr | trainable | accuracy before | after | gain (points) | eval history (step: acc) | mean step (s) "
             "| sync (s) | wall (min) | peak RSS | load start / end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in cols.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][-300:]!r} |")
            continue
        before, after = r["accuracy_before"], r["accuracy_after"]
        gain = f"{100 * (after - before):+.1f}" if before is not None and after is not None else "-"
        hist = ", ".join(f"{s}: {a:.3f}" for s, a in r["eval_history"])
        lines.append(f"| {name} | {r['learning_rate']:g} | {r['trainable_params'] / 1e6:.2f}M | {before:.3f} | {after:.3f} "
                     f"| {gain} | {hist} | {r['step_time_s']:.1f} | {r['time_weight_sync_s']:.2f} | {r['wall_s'] / 60:.1f} "
                     f"| {_fmt_bytes(r['peak_rss_bytes'])} | {_load_cell(r)} |")
    summary = report.get("summary", {})
    if summary:
        lines += ["", "| method | mean accuracy after | seed spread after (max - min) | mean gain (points) | seeds |",
                  "| --- | --- | --- | --- | --- |"]
        for kind, s in summary.items():
            lines.append(f"| {kind} | {s['mean_after']:.3f} | {s['spread_after']:.3f} | {s['mean_gain_points']:+.1f} "
                         f"| {s['seeds']} |")
    missing = [n for n in report["expected"] if n not in cols]
    if missing:
        lines += ["", f"Not run yet: {', '.join(missing)} (rerun the command: finished columns are kept)."]
    return "\n".join(lines) + "\n"


def summary_a(cols: dict) -> dict:
    out = {}
    for kind in ("full", "lora"):
        runs = [r for n, r in cols.items() if n.startswith(kind + "_") and "accuracy_after" in r
                and r["accuracy_after"] is not None and r["accuracy_before"] is not None]
        if not runs:
            continue
        after = [r["accuracy_after"] for r in runs]
        out[kind] = {"mean_after": sum(after) / len(after), "spread_after": max(after) - min(after),
                     "mean_gain_points": 100 * sum(r["accuracy_after"] - r["accuracy_before"] for r in runs) / len(runs),
                     "seeds": [r["seed"] for r in runs]}
    return out


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def _load(runs: Path, names) -> dict:
    return {n: json.loads((runs / f"{n}.json").read_text()) for n in names if (runs / f"{n}.json").exists()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", required=True, choices=["a", "b", "memory"])
    parser.add_argument("--steps", type=int, default=3, help="b: steps per column (the first a warm-up)")
    parser.add_argument("--prompts", type=int, default=4, help="b: prompts per step")
    parser.add_argument("--n", type=int, default=8, help="b: completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="b: max_completion_length")
    parser.add_argument("--mem-steps", type=int, default=2, help="memory: optimizer steps per column")
    parser.add_argument("--a-steps", type=int, default=20, help="a: steps per run (the default run's 20)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1], help="a: seeds")
    parser.add_argument("--lora-lr", type=float, default=LORA_LR, help="a: LoRA's learning rate")
    parser.add_argument("--save-steps", type=int, default=5, help="a: checkpoint every this many steps (resume point)")
    parser.add_argument("--only", nargs="*", default=None, help="columns of the part to run (default: all)")
    parser.add_argument("--force", action="store_true", help="a: rerun columns whose result exists")
    parser.add_argument("--report_only", action="store_true", help="rewrite the results from the kept columns, run nothing")
    parser.add_argument("--workdir", default="/tmp/grpo_fast_bench_lora")
    parser.add_argument("--timeout-min", type=float, default=None,
                        help="per column (default: b 20, memory 20, a 90; a column of part a stopped by it continues "
                             "from its last checkpoint when the part is run again)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rollouts", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rollouts = args.rollouts or str(Path(args.workdir) / "memory" / "rollouts.json")
    if args.child:
        if args.part == "b":
            result = child_b(args.child, args)
        elif args.part == "a":
            result = child_a(args.child, args)
        else:
            result = child_record(args) if args.child == "record" else child_memory(args.child, args)
        Path(args.result).write_text(json.dumps(result) + "\n")
        return

    timeout = args.timeout_min or {"b": 20, "memory": 20, "a": 90}[args.part]
    columns = {"b": B_COLUMNS, "memory": MEM_COLUMNS, "a": a_columns(args.seeds)}[args.part]
    names = list(columns) if args.only is None else args.only
    unknown = [n for n in names if n not in columns]
    if unknown:
        parser.error(f"unknown column(s) {unknown} for part {args.part}; expected some of {list(columns)}")
    runs = Path(args.workdir) / args.part / "runs"
    extra = ["--part", args.part, "--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
             "--max-new-tokens", str(args.max_new_tokens), "--mem-steps", str(args.mem_steps),
             "--a-steps", str(args.a_steps), "--seeds", *map(str, args.seeds), "--lora-lr", str(args.lora_lr),
             "--save-steps", str(args.save_steps),
             "--workdir", args.workdir, "--rollouts", args.rollouts]
    env = harness.environment()
    stem = RESULTS / f"lora_cpu_{args.part}"
    report = {"command": harness.whole_run_command(__file__), "machine": harness.describe(env), "environment": env}

    if args.report_only:
        names = []
    if args.part == "b":
        harness.run_children(__file__, names, extra, runs, timeout)
        cols = _load(runs, columns)  # (--only: the columns rerun, beside those kept from the last run)
        report.update(setup=(f"SmolLM2-135M-Instruct, the default task (arithmetic, math reward), {args.prompts} prompts x "
                             f"{args.n} completions, up to {args.max_new_tokens} new tokens, {args.steps} steps per column "
                             f"(the first a warm-up, the mean of the others reported), eval off, task_train_size 200; "
                             f"LoRA r 16, alpha 32, all-linear, dropout 0, lr {LORA_LR:g}; full fine-tuning lr {FULL_LR:g}; "
                             "the run's defaults otherwise (beta 0, dapo, fp32 weights under bf16 autocast, vLLM bf16)"),
                      columns=cols, ratios=ratios_b(cols), model_7b=model_7b(), load_average_end=harness.load_average())
        harness.write_results(stem, report, markdown_b(report))
        print(markdown_b(report))
    elif args.part == "memory":
        if not Path(args.rollouts).exists() and names:
            harness.run_children(__file__, ["record"], extra, runs, timeout)
        rec = _load(runs, ["record"]).get("record", {})
        if "error" in rec or not rec:
            raise SystemExit(f"recording the generation batch failed: {rec.get('error')}")
        harness.run_children(__file__, names, extra, runs, timeout)
        cols = _load(runs, columns)  # (--only: the columns rerun, beside those kept from the last run)
        report.update(record=rec, mem_steps=args.mem_steps, columns=cols, targets=targets_memory(cols),
                      model_7b=model_7b(), load_average_end=harness.load_average())
        harness.write_results(stem, report, markdown_memory(report))
        print(markdown_memory(report))
    else:
        kept = {}
        if stem.with_suffix(".json").exists():  # finished columns of an earlier run of this part
            kept = {n: r for n, r in json.loads(stem.with_suffix(".json").read_text()).get("columns", {}).items()
                    if "error" not in r}
        done = {n for n in names if not args.force and ((runs / f"{n}.json").exists()
                and "error" not in json.loads((runs / f"{n}.json").read_text()) or n in kept)}
        todo = [n for n in names if n not in done]
        if done:
            print(f"[bench_lora] kept (use --force to rerun): {sorted(done)}", flush=True)

        def write() -> dict:
            cols = {**kept, **_load(runs, names)}
            cols = {n: cols[n] for n in columns if n in cols}
            report.update(setup=(f"SmolLM2-135M-Instruct, the default run's settings (GRPOConfig defaults: arithmetic, math "
                                 f"reward, 8 prompts x 8 completions, up to 64 new tokens, vLLM, beta 0, dapo, eval every 5 "
                                 f"steps and before training on 200 held-out prompts, greedy), {args.a_steps} steps; full "
                                 f"fine-tuning at lr {FULL_LR:g}; LoRA r 16, alpha 32, all-linear, lora_sync auto (merged), "
                                 f"lr {args.lora_lr:g}; seeds {args.seeds}"),
                          expected=list(columns), columns=cols, summary=summary_a(cols),
                          load_average_end=harness.load_average())
            harness.write_results(stem, report, markdown_a(report))
            return report

        for name in todo:  # one at a time, the report rewritten after each (an interrupted run keeps the others)
            harness.run_children(__file__, [name], extra, runs, timeout)
            write()
        print(markdown_a(write()))


if __name__ == "__main__":
    main()
