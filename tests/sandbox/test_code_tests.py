"""code_tests on hand-written programs (right, wrong, partial in both modes, syntax error, no code, timeout, a
forged exit), the sandbox pool's concurrency, the refusal without bubblewrap and --unsafe_code_execution's
warning, the humaneval task, and a training run whose programs misbehave in every way the counters count."""

import asyncio
import json
import math
import os
import time

import pytest

from grpo_fast.config import GRPOConfig
from grpo_fast.data.tasks import humaneval_rows
from grpo_fast.rewards import get_reward_funcs
from grpo_fast.rewards.code import CodeTests, check_asserts, program_of
from grpo_fast.rewards.sandbox import Sandbox, SandboxOptions
from grpo_fast.trainer import GRPOTrainer
from tests.trainer.common import config
from tests.trainer.conftest import one_thread  # noqa: F401 (autouse: one thread, as the trainer tests)

FAST = SandboxOptions(timeout=2, cpu_seconds=1, memory_mb=512, max_processes=8, output_bytes=4096, tmp_mb=16, workers=4)
PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n    assert candidate(2, 2) == 4\n"


def _score(completions, mode="all", **columns):
    reward = CodeTests(FAST, code_reward_mode=mode)
    n = len(completions)
    columns = {k: [v] * n for k, v in columns.items()} or {"test": [TEST] * n, "entry_point": ["add"] * n}
    values = asyncio.run(reward([PROMPT] * n, completions, **columns))
    return values, reward.metrics()


def test_right_wrong_partial_and_broken_programs():
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",  # right (a fenced block defining add)
        "    return a + b\n",  # right (HumanEval's format: the prompt continued)
        "```python\ndef add(a, b):\n    return a - b\n```",  # wrong: passes candidate(0, 0) only
        "```python\ndef add(a, b):\n    return 4 if a == 2 else a - b\n```",  # partial: passes 2 of 3
        "```python\ndef add(a, b) return a\n```",  # syntax error
        "",  # no code
        "    while True:\n        pass\n",  # runs past the limits
        "```python\nimport os\ndef add(a, b):\n    os._exit(0)\n```",  # exits 0 before the tests end: not a pass
        "```python\nexec = print = len = lambda *a, **k: None\ndef add(a, b):\n    return a - b\n```",  # rebinds
        # right, and reads stdin: nothing there (the key never reaches the program's process), scored on its merits
        "```python\nimport sys\nprint('stolen', sys.stdin.read())\ndef add(a, b):\n    return a + b\n```",
    ]
    values, counts = _score(completions)
    assert values == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert counts["code/syntax_errors"] == 1 and counts["code/no_code"] == 1 and counts["sandbox/timeouts"] == 1
    shares, _ = _score(completions, mode="share")
    assert shares[:4] == [1.0, 1.0, 1 / 3, 2 / 3] and shares[4:8] == [0.0] * 4
    assert shares[8:] == [1 / 3, 1.0], "rebinding exec/print/len in its own process fakes nothing"
    asserts = ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(2, 2) == 5"]  # MBPP-style
    assert _score([completions[0]], mode="share", tests=asserts)[0] == [2 / 3]
    assert _score([completions[0]], mode="all", tests=asserts)[0] == [0.0]


def test_the_program_a_completion_holds():
    assert program_of(PROMPT, "text\n```python\nx = 1\n```\n```py\ndef add(a, b): pass\n```", "add") == "def add(a, b): pass\n"
    assert program_of(PROMPT, "```python\nx = 1\n```", "add") == PROMPT + "```python\nx = 1\n```"
    assert program_of(PROMPT, " \n", "add") is None
    assert program_of([{"role": "user", "content": PROMPT}], [{"role": "assistant", "content": "    pass\n"}], "add") == PROMPT + "    pass\n"
    assert check_asserts(TEST) == ["assert candidate(1, 2) == 3", "assert candidate(0, 0) == 0", "assert candidate(2, 2) == 4"]


def test_the_pool_runs_workers_programs_at_once():
    box = Sandbox(SandboxOptions(timeout=10, workers=8))
    # each program sleeps far longer than a program takes to start on a loaded 2-core machine (0.5 s was not: the
    # last of a wave of 8 sometimes started after the first had ended, and 7 were seen at once)
    n, sleep = 16, 1.5
    program = f"import time\nprint(time.time())\ntime.sleep({sleep})\nprint(time.time())"

    async def all_of_them():
        return await asyncio.gather(*(box.run_async(program) for _ in range(n)))

    start = time.monotonic()
    results = asyncio.run(all_of_them())
    wall = time.monotonic() - start
    box.close()
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    assert all(r.ok for r in results)
    at_most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert at_most == 8, f"{at_most} programs ran at once"
    assert wall < n * sleep / 2, f"{n} x {sleep} s took {wall:.1f} s"  # (a loose backstop: 8 at a time is ~3 s)


def test_without_bubblewrap_model_code_is_refused_unless_unsafe(monkeypatch, tmp_path, capsys, tiny):
    from tests.trainer.common import rows, target_fraction

    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # bwrap hidden
    with pytest.raises(RuntimeError, match=r"refusing to run model-written code without isolation: bubblewrap \(bwrap\) "
                                           r"is not installed: apt-get install bubblewrap .*--unsafe_code_execution"):
        Sandbox(SandboxOptions(timeout=3, workers=1))
    unsafe = Sandbox(SandboxOptions(timeout=3, workers=1, unsafe=True))
    assert unsafe.run("print(6 * 7)").stdout == "42\n"
    unsafe.close()
    reward = CodeTests(SandboxOptions(timeout=3, workers=1, unsafe=True))  # limits only: it still scores
    assert asyncio.run(reward([PROMPT] * 2, ["    return a + b\n", "    return a\n"], test=[TEST] * 2,
                              entry_point=["add"] * 2)) == [1.0, 0.0]
    monkeypatch.setenv("PATH", path)
    c = config(tmp_path, max_steps=1, eval_before_train=False, save_final=False, report_to="none",
               unsafe_code_execution=True)
    GRPOTrainer(c, [target_fraction], rows(), model=tiny[0], tokenizer=tiny[1]).train()
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "warning: --unsafe_code_execution: model-written code runs WITHOUT isolation (limits only)"


def test_the_humaneval_task_splits_by_task_id_and_needs_code_tests(tmp_path):
    train, test = humaneval_rows(split="train"), humaneval_rows(split="test")
    assert len(train) == 124 and len(test) == 40 and not {r["task_id"] for r in train} & {r["task_id"] for r in test}
    assert humaneval_rows(split="test") == test and {"prompt", "test", "entry_point"} <= set(test[0])
    assert len(humaneval_rows(300, split="train")) == 300
    with pytest.raises(ValueError, match=r"GRPOConfig.reward_funcs=\['math'\] is invalid: expected code_tests"):
        GRPOConfig(task="humaneval", output_dir=str(tmp_path))
    canonical = [r["prompt"] + r["canonical_solution"] for r in test[:6]]
    reward = get_reward_funcs(["code_tests"], sandbox=FAST)[0]
    values = asyncio.run(reward([r["prompt"] for r in test[:6]], ["```python\n" + c + "\n```" for c in canonical],
                                test=[r["test"] for r in test[:6]], entry_point=[r["entry_point"] for r in test[:6]]))
    assert values == [1.0] * 6, "HumanEval's own solutions pass in the sandbox"


MISBEHAVING = [
    "```python\ndef add(a, b):\n    return a + b\n```",
    "```python\ndef add(a, b):\n    while True: pass\n```",  # CPU time
    "```python\ndef add(a, b):\n    import time; time.sleep(60)\n```",  # wall time
    "```python\ndef add(a, b):\n    x = bytearray(10 * 2**30)\n```",  # memory
    "```python\nimport os\ndef add(a, b):\n    while True: os.fork()\n```",  # processes
    "```python\nimport sys\ndef add(a, b):\n    while True: sys.stdout.write('x' * 65536)\n```",  # output
    "```python\nimport os\ndef add(a, b):\n    os.kill(1, 9); os.system('rm -rf /tmp /usr')\n```",
    "```python\ndef add(a, b):\n    return a - b\n```",
]


def test_training_survives_programs_that_misbehave(tmp_path, tiny, process_limit_in_force):
    """Every completion is replaced by one of the misbehaving programs: the steps complete, and each counter
    of what they hit is > 0."""
    # (64 KiB of output a stream, the default: the fork bomb's processes each print a traceback, which must not
    # reach the output limit before the process limit is seen)
    reward = CodeTests(SandboxOptions(timeout=2, cpu_seconds=1, memory_mb=512, max_processes=8, tmp_mb=16, workers=4))

    async def code_tests(prompts, completions, **columns):
        chosen = [MISBEHAVING[k % len(MISBEHAVING)] for k in range(len(completions))]
        return await reward(prompts, chosen, **columns)

    code_tests.counters = reward
    rows = [{"prompt": PROMPT, "test": TEST, "entry_point": "add"}] * 8
    c = config(tmp_path, max_steps=2, eval_before_train=False, save_final=False, report_to="none", num_generations=8,
               per_device_train_batch_size=8)
    GRPOTrainer(c, [code_tests], rows, model=tiny[0], tokenizer=tiny[1]).train()
    steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if '"loss"' in line]
    assert [s["step"] for s in steps] == [1, 2]
    for counter in ("sandbox/timeouts", "sandbox/oom", "sandbox/process_limit", "sandbox/output_limit"):
        assert all(s[counter] > 0 for s in steps), (counter, [s[counter] for s in steps])
    assert all(s["rewards/code_tests/mean"] == pytest.approx(1 / 8) and math.isfinite(s["loss"]) for s in steps)
    from tests.sandbox.test_escapes import _slot_processes

    assert _slot_processes() == [] and os.path.isdir("/usr/bin"), "a program outlived its step, or reached the host"


def test_the_python_tool_runs_code_in_the_sandbox_and_is_a_typed_documented_tool():
    from transformers.utils import get_json_schema

    from grpo_fast.rewards.code import python_tool

    assert python_tool("print(sum(range(10)))") == "45\n"
    failed = python_tool("import os; print(os.listdir('/root'))")
    assert "FileNotFoundError" in failed and "[exited, exit status 1]" in failed
    schema = get_json_schema(python_tool)["function"]
    assert schema["name"] == "python_tool" and schema["parameters"]["required"] == ["code"]


def test_code_tests_without_its_columns_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from grpo_fast import models

    monkeypatch.setattr(models, "load_policy", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    reward = get_reward_funcs(["code_tests"], sandbox=FAST)[0]
    with pytest.raises(ValueError, match=r"^reward function 'code_tests' reads the columns \['test', 'entry_point'\] "
                                         r"\(HumanEval's test program and the function it tests\) or \['tests'\] \(assert "
                                         r"statements\), which train_dataset does not have \(columns: \['answer', 'prompt'\]\); "
                                         r"add them or choose other reward_funcs$"):
        GRPOTrainer(config(tmp_path, model="unused"), [reward], [{"prompt": f"q{i}", "answer": "1"} for i in range(8)])
    assert CodeTests.missing_columns({"prompt", "tests"}) == CodeTests.missing_columns({"test", "entry_point"}) == ""
    assert CodeTests.missing_columns({"prompt", "test"}).startswith("the columns ['entry_point'] ")


def test_correct_programs_submitted_at_once_do_not_time_out():
    """16 correct programs of ~0.3 s of CPU each (0.1 s a test), all at once, on the default pool and a 1 s wall
    limit: none times out. (Before, 4 x cores ran at once on a wall clock: each got a quarter of a core and about
    1.4 s of wall time.) The machine's other load is not charged either (sandbox._Clock)."""
    busy = ("```python\ndef add(a, b):\n    import time\n    end = time.process_time() + 0.1\n"
            "    while time.process_time() < end:\n        pass\n    return a + b\n```")
    reward = CodeTests(SandboxOptions(timeout=1.0, cpu_seconds=5, memory_mb=512, max_processes=8, tmp_mb=16))
    values = asyncio.run(reward([PROMPT] * 16, [busy] * 16, test=[TEST] * 16, entry_point=["add"] * 16))
    counts = reward.metrics()
    assert counts["sandbox/timeouts"] == 0 and values == [1.0] * 16, (values, counts)


def test_tests_that_read_the_programs_imports():
    """MBPP's tests read modules the program imported (`math.isclose`): the harness imports the same module itself."""
    program = "```python\nimport math\ndef volume(r):\n    return 4 / 3 * math.pi * r ** 3\n```"
    tests = ["assert math.isclose(volume(1), 4.18879, rel_tol=1e-4)", "assert math.isclose(volume(2), 33.5103, rel_tol=1e-4)"]
    for mode in ("all", "share"):
        assert asyncio.run(CodeTests(FAST, code_reward_mode=mode)(["Write volume(r)."], [program], tests=[tests])) == [1.0]
