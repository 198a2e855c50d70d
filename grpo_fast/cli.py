"""`grpo-fast train | eval | bench`.

    grpo-fast train                          SmolLM2-135M-Instruct on the arithmetic task (the default run)
    grpo-fast train --config run.yaml --max_steps 100 --engine hf --learning_rate 5e-6
    grpo-fast train --output_dir out --resume           continue from out/checkpoint-* (latest), with the run's options
    grpo-fast train --nproc_per_node 2                  one node, 2 ranks (torchrun; or run torchrun yourself)
    grpo-fast eval --model out/final --task arithmetic  held-out accuracy of a model
    grpo-fast bench                                     the fused-loss benchmark (benchmarks/bench_loss.py)

Every GRPOConfig field is an option (`--<field> VALUE`); `grpo-fast train --help` lists them with
their help text. Precedence: defaults < --config file < command-line options.

`grpo-fast train` (one process) trains in a child process and exits with its status (`launcher.supervise`), so
that a run that ended without finishing never exits 0 (a tool's os._exit(0) would otherwise read as success).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing
from typing import Optional

from . import launcher, processes
from .config import GRPOConfig, field_types, read_yaml


def _parse_value(name: str, annotation):
    """An argparse `type=` for a config field: YAML-ish values ('none', lists, bools), typed."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = typing.get_origin(args[0] if args else annotation) or (args[0] if args else annotation)
    optional = type(None) in typing.get_args(annotation)

    def parse(text: str):
        import yaml

        if optional and text.lower() in ("none", "null"):
            return None
        if base is str:
            return text
        if base is list:
            value = yaml.safe_load(text) if text.strip().startswith("[") else [yaml.safe_load(v) for v in text.split(",")]
            return [v for v in value]
        if base is dict:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                raise argparse.ArgumentTypeError(f"--{name}: expected a JSON object, got {text!r} ({err})") from None
            if not isinstance(value, dict):
                raise argparse.ArgumentTypeError(f"--{name}: expected a JSON object, got {text!r}")
            return value
        if base is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise argparse.ArgumentTypeError(f"--{name}: expected true or false, got {text!r}")
        try:
            return base(yaml.safe_load(text)) if base is float else base(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"--{name}: expected {base.__name__}, got {text!r}") from None

    return parse


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """One `--<field>` per GRPOConfig field; help from the field's metadata. Unset options stay out."""
    types = field_types()
    group = parser.add_argument_group("GRPOConfig fields (defaults shown; see grpo_fast/config.py)")
    for f in dataclasses.fields(GRPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        extra = {"nargs": "?", "const": True} if types[f.name] is bool else {}
        group.add_argument(
            f"--{f.name}", type=_parse_value(f.name, types[f.name]), default=argparse.SUPPRESS,
            metavar=("{" + ",".join(map(str, choices)) + "}") if choices else f.name.upper(),
            help=f"{f.metadata['help']} (default: {default!r})", **extra,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-fast", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"grpo-fast {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy with GRPO", description=__doc__, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", help="a YAML file of GRPOConfig fields")
    train.add_argument("--resume", action="store_true",
                       help="resume from the latest checkpoint in output_dir, with the run's saved options: give only "
                            "what changes. Run control (max_steps, max_train_minutes, save_*, logging_steps, eval_*, "
                            "log_level, ...) and the layout (ranks, micro-batches, backend) may change; any other "
                            "changed option is refused unless named in --resume_override")
    train.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    train.add_argument("--nproc_per_node", type=int, default=1,
                       help="ranks on this node: relaunch under torchrun --standalone with this many processes (one "
                            "per GPU, or per CPU slot with gloo); the global batch is per_device_train_batch_size x "
                            "ranks x gradient_accumulation_steps. For many nodes run torchrun yourself: "
                            "torchrun --nnodes M --nproc_per_node N --rdzv_backend c10d --rdzv_endpoint HOST:PORT "
                            "-m grpo_fast.cli train ...")
    _add_config_options(train)

    ev = sub.add_parser("eval", help="held-out accuracy of a model (greedy, the reward functions' first as accuracy)",
                        allow_abbrev=False)
    ev.add_argument("--config", help="a YAML file of GRPOConfig fields")
    ev.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    _add_config_options(ev)

    bench = sub.add_parser("bench", help="benchmark the fused GRPO loss against plain PyTorch (and Liger)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to benchmarks/bench_loss.py")
    return parser


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    """The config of `train`/`eval`: defaults < --config file < command-line options. On resume, the
    run's saved config takes the defaults' place and what is given is checked against it (resume.py)."""
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "config", "resume", "args", "debug", "nproc_per_node")}
    if getattr(args, "resume", False):
        given.setdefault("resume_from_checkpoint", "latest")
    file_values = read_yaml(args.config) if args.config else {}
    spec = given.get("resume_from_checkpoint", file_values.get("resume_from_checkpoint"))
    if args.command == "train" and spec is not None:
        from .run.resume import resumed_config

        output_dir = given.get("output_dir", file_values.get("output_dir", GRPOConfig.output_dir))
        return resumed_config({**file_values, **given}, output_dir, spec)
    if args.config:
        return GRPOConfig.from_yaml(args.config, **given)
    return GRPOConfig.from_dict({}, **given)


def cmd_train(config: GRPOConfig) -> dict:
    from .trainer import GRPOTrainer

    start = time.perf_counter()
    trainer = GRPOTrainer.from_config(config)
    trainer.train()
    if not trainer.world.main:  # under torchrun, rank 0 reports
        return {"steps": trainer.state.step}
    history = trainer.state.eval_history
    summary = {"steps": trainer.state.step, "wall_time_s": round(time.perf_counter() - start, 1),
               "eval_history": history, "output_dir": config.output_dir}
    if len(history) >= 2:
        before, after = history[0][1], history[-1][1]
        summary.update(accuracy_before=before, accuracy_after=after, gain_points=round(100 * (after - before), 1))
        where = f"in {summary['wall_time_s'] / 60:.1f} min; metrics, plot and model in {config.output_dir}"
        means = [m for _, m in trainer.state.eval_reward_history]
        if all(0 <= m <= 1 for m in means):  # a 0/1 correctness score: accuracy = share of first reward > 0
            print(f"held-out accuracy: {100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points) {where}")
        else:  # the first reward is no 0/1 correctness score: its mean, no percentage
            print(f"held-out mean of the first reward ({config.reward_funcs[0]}): {means[0]:.4g} -> {means[-1]:.4g} {where}")
    for name, values in trainer.state.eval_metric_history.items():  # the task's own metrics
        if len(values) >= 2:
            before, after = values[0][1], values[-1][1]
            summary.update({f"{name}_before": before, f"{name}_after": after})
            print(f"held-out {name}: {before:.3f} -> {after:.3f} ({after - before:+.3f})")
    with open(os.path.join(config.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def cmd_eval(config: GRPOConfig) -> dict:
    from .trainer import GRPOTrainer

    trainer = GRPOTrainer.from_config(config, evaluate_only=True)
    if trainer.eval_rows is None:
        raise SystemExit("grpo-fast eval: the dataset has no held-out ('test') split; use --task arithmetic or a dataset folder with test.jsonl")
    metrics = trainer.evaluate()
    print(json.dumps(metrics, indent=2))
    return metrics


def cmd_bench(extra: list[str]) -> int:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_loss.py")
    if os.path.exists(script):
        return subprocess.call([sys.executable, script, *extra])
    return _quick_loss_bench()


def _quick_loss_bench() -> int:
    """Without the repository's benchmarks/: time the fused loss against plain PyTorch logits, once."""
    import torch

    from .objective import grpo_loss_reference
    from .ops import fused_linear_grpo_loss

    B, T, H, V = 4, 256, 512, 32768
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.02).requires_grad_(True)
    target, adv, mask = torch.randint(0, V, (B, T)), torch.randn(B), torch.ones(B, T)
    for name, fn in [("plain torch (logits)", lambda: grpo_loss_reference(hidden @ weight.T, target, adv, mask)[0]),
                     ("grpo_fast fused", lambda: fused_linear_grpo_loss(hidden, weight, target, adv, mask)[0])]:
        fn().backward()  # warm-up
        start = time.perf_counter()
        fn().backward()
        print(f"{name:22s} fwd+bwd B={B} T={T} H={H} V={V}: {1000 * (time.perf_counter() - start):.0f} ms")
    return 0


def _reject_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """An unknown option is an error that lists the close GRPOConfig fields."""
    import difflib

    from .config import field_names

    hints = []
    for option in (u for u in unknown if u.startswith("--")):
        name = option[2:].split("=")[0]
        close = difflib.get_close_matches(name, [*field_names(), "config", "resume"], n=3, cutoff=0.6)
        hints.append(option + (f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""))
    parser.error(f"unknown option(s): {'; '.join(hints) or ' '.join(unknown)}")


# Errors that come from what the user gave (config, data, model folder, reward functions, disk):
# one line each; --debug shows the traceback.
_USER_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError, OSError, RuntimeError)


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "bench":
        _reject_unknown(parser, unknown)
    if args.command == "bench":
        return cmd_bench(args.args)
    if argv is None and args.command == "train" and args.nproc_per_node == 1 and launcher.wants_supervisor():
        return launcher.supervise([*launcher.this_command(), *sys.argv[1:]])
    finished = launcher.supervised_child()
    try:
        code = _command(args, argv)
    except SystemExit:  # (user code's sys.exit(): not how the command ends, so not a finished run)
        raise
    except BaseException:  # (a program error: its traceback is printed, the exit status is 1)
        launcher.say_finished(finished)
        raise
    launcher.say_finished(finished)
    return code


def _command(args: argparse.Namespace, argv) -> int:
    """The command in this process; its exit code."""
    if args.command == "train":
        if "WORLD_SIZE" in os.environ:  # a rank under torchrun: it ends with its launcher, kill -9 included
            processes.die_with_launcher()
        _remove_stale_temp_folders(args)  # before any refusal below
    if args.command == "train" and args.nproc_per_node != 1 and "WORLD_SIZE" not in os.environ:
        return launch(args.nproc_per_node, sys.argv[1:] if argv is None else list(argv), args)
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:  # (OSError: a config file or checkpoint that is not there)
        print(f"grpo-fast {args.command}: {err}", file=sys.stderr)
        return 2
    _set_log_level(config.log_level)
    # a signal outside the training loop (which saves on its own): one line and 128 + signal too
    previous = {s: signal.signal(s, _stop_outside_training) for s in (signal.SIGINT, signal.SIGTERM)
                if args.command == "train" and threading.current_thread() is threading.main_thread()}
    try:
        if args.command == "train":
            cmd_train(config)
        else:
            cmd_eval(config)
    except BaseException as err:
        return _exit_code(err, args, config.output_dir)
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # (a rank keeps ignoring the SIGTERM torchrun sends
            for s, handler in previous.items():           # the survivors once one failed: it exits by itself)
                signal.signal(s, handler)
    return 0


def _exit_code(err: BaseException, args: argparse.Namespace, output_dir: str) -> int:
    """One line on stderr for how `err` ended the command, and the exit code (re-raised when it is a
    program error, or with --debug). Under torchrun one rank speaks for all where they all stop
    alike; a rank whose collective broke because a peer died names that rank."""
    from .train.interrupt import Interrupted
    from .trainer import TrainingInterrupted

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if ranks > 1:
        for s in (signal.SIGINT, signal.SIGTERM):  # torchrun stops the survivors: say why first
            signal.signal(s, signal.SIG_IGN)
        line = peer_death_line(err, f"grpo-fast {args.command}", output_dir, rank, ranks)
        if line is not None:
            if line:
                print(line, file=sys.stderr, flush=True)
            return 1
    if isinstance(err, (TrainingInterrupted, Interrupted, KeyboardInterrupt)):
        line = str(err) or "interrupted"  # (KeyboardInterrupt: a second signal in the training loop)
        if isinstance(err, Interrupted):
            line = f"{err} outside the training loop (loading or finishing): stopped, nothing more to save"
        if rank == 0:  # (every rank stopped at the same round start, and rank 0 saved)
            print(f"grpo-fast {args.command}: {line}", file=sys.stderr, flush=True)
        return 128 + getattr(err, "signum", signal.SIGINT)
    if isinstance(err, _USER_ERRORS) and not args.debug:
        print(f"grpo-fast {args.command}: {type(err).__name__}: {_one_line(err)} (--debug shows the traceback)",
              file=sys.stderr)
        return 1
    raise err


def peer_death_line(err: BaseException, prefix: str, output_dir: str, rank: int, ranks: int) -> Optional[str]:
    """What rank `rank` says when `err` ended it: None when `err` is no collective broken by a dead
    peer on this host; else the line naming the dead rank(s) ('' on all but the lowest surviving
    rank, so that one rank says it)."""
    from .distributed import dead_peers, is_collective_failure

    if not is_collective_failure(err):
        return None
    dead = dead_peers()
    if not dead:
        return None
    if rank != min(set(range(ranks)) - {r for r, _ in dead}):
        return ""
    which = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
    return (f"{prefix}: {which} died, so rank {rank} stopped (every rank takes part in each step); continue from "
            f"the latest checkpoint with `grpo-fast train --output_dir {output_dir} --resume --nproc_per_node {ranks}`")


def _stop_outside_training(signum, frame):
    from .train.interrupt import Interrupted

    raise Interrupted(signum)


def _remove_stale_temp_folders(args: argparse.Namespace) -> None:
    """The temporary folders killed checkpoint writes left in output_dir (run_folder.py), removed at
    every start before anything can refuse it (the output_dir as config_from_args will read it)."""
    from .run.folder import remove_stale_temp_folders_unless_locked

    if os.environ.get("RANK", "0") != "0":
        return  # (rank 0 does it)
    output_dir = getattr(args, "output_dir", None)
    if output_dir is None and args.config:
        try:
            output_dir = read_yaml(args.config).get("output_dir")
        except (ValueError, OSError):
            return  # (config_from_args reports it)
    remove_stale_temp_folders_unless_locked(output_dir or GRPOConfig.output_dir)


def launch(nproc: int, argv: list[str], args: argparse.Namespace) -> int:
    """`grpo-fast train --nproc_per_node N ...` as `torchrun --standalone --nproc_per_node N -m
    grpo_fast.cli train ...` (the same arguments; each rank then sees WORLD_SIZE and trains), with the
    agent in this process (launcher.py). What would stop every rank alike is checked here first and
    said once, with the code one process gives: options (2), a tracker's login, the output folder, many-rank
    limits, the model folder (1)."""
    if nproc < 1:
        print(f"grpo-fast train: --nproc_per_node must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as err:
        print(f"grpo-fast train: {err}", file=sys.stderr)
        return 2
    from .config_checks import check_ranks
    from .reporting import trackers
    from .run import folder as run_folder

    try:
        trackers.check_credentials(config.report_to)  # (once here, not once a rank)
        folder = run_folder.RunFolderOptions.from_config(config)
        run_folder.check_start(folder, warn=False)  # (rank 0 warns, when it resumes from step 0)
        if nproc > 1:
            check_ranks(config, nproc)  # (what many ranks do not run yet, before torchrun starts)
        from .models import DEFAULT_MODEL, lora, resolve_model_path

        model = config.model
        if lora.is_adapter_folder(model):  # a PEFT adapter: its base is what must be there
            model = lora.adapter_base(model, config.lora_base_model)
        if model not in (None, "default", DEFAULT_MODEL):  # a folder that is not there, or incomplete
            resolve_model_path(model)  # (the default model's cached conversion is left to the ranks)
            if config.sequence_parallel_size > 1:  # the head rule of sequence parallelism, from config.json
                from .train.ulysses import check_heads_of_folder

                check_heads_of_folder(model, config.sequence_parallel_size)
    except (ValueError, FileNotFoundError) as err:
        if args.debug:
            raise
        print(f"grpo-fast train: {type(err).__name__}: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return 1
    return launcher.run_torchrun(nproc, argv, debug=args.debug)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or repr(err)


def _set_log_level(level: str) -> None:
    """grpo_fast's and vLLM's log level (vLLM reads its own before it is imported). At 'warning' the
    progress bar and grpo_fast's warnings show; vLLM's per-start and per-request notices do not."""
    import logging

    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpo_fast").setLevel(level.upper())
    # vLLM's WARNING lines on the CPU repeat for every engine start and say nothing actionable
    # (no CUDA, no sleep mode, ...): shown from 'info' on, errors always
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if level in ("warning", "error") else level.upper())
    if level in ("warning", "error"):  # transformers' per-save and per-load bars would bury the run's own bar
        import warnings

        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        logging.getLogger("vllm").setLevel(logging.ERROR)  # what it logs before it reads VLLM_LOGGING_LEVEL
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # deprecations inside vLLM


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpo_fast")
    except PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
