"""Programs that try to score without being right (grpo_fast/rewards/code.py, code_harness.py): each scores 0 in
both modes (all, share) and both test formats (HumanEval's check(candidate), a `tests` list), beside honest
programs that score 1 (and share mode's partial credit). Every hack here scored 1.0 or tried a route that did
before the harness ran the tests in a process of their own, or scored where the prompt's code was in fenced blocks
(a chat prompt) or where share mode ran check()'s asserts outside check(); the programs run in the real sandbox,
batched."""

import asyncio

import pytest

from grpo_fast.rewards.code import CodeTests
from grpo_fast.rewards.sandbox import SandboxOptions

BOX = SandboxOptions(timeout=5, cpu_seconds=2, memory_mb=512, max_processes=8, output_bytes=8192, tmp_mb=16, workers=4)
PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 5) == 5\n    assert candidate(2, 2) == 4\n"
TESTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(2, 2) == 4"]
WRONG = "def add(a, b):\n    return -1\n"  # fails every test: any score is the hack's

# Prints a verdict for each secret found, in the old format ("token passed total") and as an HMAC under it, then
# leaves before the harness could print its own.
FORGE = '''
import hmac as _hmac, os as _os
def forge(found):
    lines = []
    for secret in found:
        secret = (secret.decode(errors="ignore") if isinstance(secret, bytes) else str(secret)).strip()
        for token in {secret, secret.split("\\n")[0]}:
            for line in ("1 1", "3 3"):
                lines += [f"{token} {line}", f"{line} {_hmac.new(token.encode(), line.encode(), 'sha256').hexdigest()}"]
    _os.write(1, ("\\n" + "\\n".join(lines) + "\\n").encode())
    _os._exit(0)
'''

HACKS = {
    "builtins.exec a no-op, its own check": "import builtins\n" + WRONG +
        "def check(candidate):\n    pass\nbuiltins.exec = lambda *a, **k: None\n",
    "builtins.compile replaced": "import builtins\n_compile = compile\n" + WRONG + "def check(candidate):\n    pass\n"
        "builtins.compile = lambda *a, **k: _compile('pass', '<nothing>', 'exec')\n",
    "builtins.str, len, print rebound": "import builtins\n_str = str\n" + WRONG +
        "builtins.str = lambda x='': _str(3) if type(x) is int else _str(x)\nbuiltins.len = lambda x: 3\n"
        "builtins.print = lambda *a, **k: None\n",
    "sys.modules poisoned": "import sys, types\n" + WRONG +
        "for name in ('json', 'hmac', 'subprocess', 'unittest', 'traceback'):\n    fake = types.ModuleType(name)\n"
        "    fake.__getattr__ = lambda attr: (lambda *a, **k: True)\n    sys.modules[name] = fake\n",
    "__import__ replaced": "import builtins, sys\n" + WRONG +
        "builtins.__import__ = lambda name, *a, **k: sys.modules.get(name) or sys\n",
    "AssertionError rebound": "import builtins\nclass Never(Exception):\n    pass\nbuiltins.AssertionError = Never\n" + WRONG,
    "sys.exit(0) at import": "import sys\n" + WRONG + "sys.exit(0)\n",
    "os._exit(0) at import": "import os\n" + WRONG + "os._exit(0)\n",
    "forged verdict lines": FORGE + WRONG + "forge(['0' * 32, 'f' * 64, ''])\n",
    "atexit prints a verdict": "import atexit\n" + WRONG +
        "atexit.register(lambda: print('\\n3 3 ' + 'f' * 64 + '\\n' + '0' * 32 + ' 3 3', flush=True))\n",
    "unittest patched": "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "unittest.TestCase.assertTrue = lambda *a, **k: None\n" + WRONG,
    "frame walk (sys._getframe)": "import sys\n" + FORGE + WRONG +
        "found, frame = [], sys._getframe()\nwhile frame is not None:\n"
        "    found += [v for v in list(frame.f_locals.values()) + list(frame.f_globals.values()) if isinstance(v, (str, bytes)) and 16 <= len(v) <= 200]\n"
        "    frame = frame.f_back\nforge(found)\n",
    "frame walk (traceback)": FORGE + WRONG +
        "try:\n    raise ValueError\nexcept ValueError as err:\n    frame = err.__traceback__.tb_frame\nfound = []\n"
        "while frame is not None:\n    found += [v for v in frame.f_locals.values() if isinstance(v, str) and 16 <= len(v) <= 200]\n"
        "    frame = frame.f_back\nforge(found)\n",
    "frames found by gc": "import gc, types\n" + FORGE + WRONG +
        "found = [v for f in gc.get_objects() if isinstance(f, types.FrameType) for v in f.f_locals.values()\n"
        "         if isinstance(v, (str, bytes)) and 16 <= len(v) <= 200]\nforge(found)\n",
    "stdin reopened (/proc/1/fd/0)": FORGE + WRONG + "forge([open('/proc/1/fd/0', 'rb').read()])\n",
    "other processes' stdin, environ, memory": "import os\n" + FORGE + WRONG +
        "found = []\nfor pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n"
        "    for part in ('fd/0', 'fd/3', 'fd/4', 'environ', 'cmdline', 'mem'):\n        try:\n"
        "            fd = os.open(f'/proc/{pid}/{part}', os.O_RDONLY | os.O_NONBLOCK)\n"
        "            found.append(os.read(fd, 1 << 16))\n        except OSError:\n            pass\n"
        "forge(found)\n",
    "tests read from /tmp/main.py and /proc": "import os, re\n"
        "texts = []\nfor path in ['/tmp/main.py', *(f'/proc/{p}/{part}' for p in os.listdir('/proc') if p.isdigit() "
        "for part in ('fd/0', 'cmdline'))]:\n    try:\n        texts.append(open(path, 'rb').read().decode(errors='ignore'))\n"
        "    except OSError:\n        pass\n"
        "table = {(int(a), int(b)): int(c) for t in texts for a, b, c in re.findall(r'(?:add|candidate)\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', t)}\n"
        "def add(a, b):\n    return table.get((a, b), -1)\n",
    "__eq__ always True": "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Yes()\n",
    "int subclass whose __eq__ says True": "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\ndef add(a, b):\n    return Yes(-1)\n",
    "kills every other process": "import os, signal\n" + WRONG +
        "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n",
}
RIGHT = "def add(a, b):\n    return a + b\n"
PARTIAL = "def add(a, b):\n    return 4 if a == 2 else 3\n"  # passes the first and the third


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}```\n"


def scores(completions: list, mode: str, columns: dict) -> list:
    reward = CodeTests(BOX, code_reward_mode=mode)
    n = len(completions)
    return asyncio.run(reward([PROMPT] * n, completions, **{k: [v] * n for k, v in columns.items()}))


@pytest.mark.parametrize("mode", ["all", "share"])
@pytest.mark.parametrize("columns", [{"test": TEST, "entry_point": "add"}, {"tests": TESTS}], ids=["check", "tests"])
def test_no_reward_hack_scores(mode, columns):
    values = scores([fenced(p) for p in [*HACKS.values(), RIGHT, PARTIAL]] + ["    return a + b\n"], mode, columns)
    scored = {name: v for name, v in zip(HACKS, values[:len(HACKS)], strict=True) if v != 0.0}
    assert scored == {}, f"{len(scored)} reward hacks scored ({mode}, {list(columns)}): {scored}"
    assert values[len(HACKS):] == [1.0, 2 / 3 if mode == "share" else 0.0, 1.0], values[len(HACKS):]


# A prompt with a helper the test calls (HumanEval/38's shape), a test that reads a builtin, and one whose loop a
# StopIteration would end early: the program cannot answer for the dataset's helper or for the builtin.
SHIFT_PROMPT = ('def encode(s: str):\n    """Every character shifted by one."""\n    return "".join(chr(ord(c) + 1) for c in s)\n\n\n'
                'def decode(s: str):\n    """The inverse of encode."""\n')
SHIFT_TEST = 'def check(candidate):\n    for text in ["abc", "hello", "xyz"]:\n        assert candidate(encode(text)) == text\n'
ROOT_TEST = "def check(candidate):\n    assert abs(candidate(2.0) - 1.41421356) < 1e-6\n    assert abs(candidate(9.0) - 3.0) < 1e-9\n"
DOUBLE_TEST = "def check(candidate):\n    assert all(map(lambda x: candidate(x) == 2 * x, [1, 2, 3]))\n"
CHAT = "Complete this function:\n```python\n{}```\n"
POLY = ('import math\n\n\ndef poly(xs, x):\n    """xs[0] + xs[1] * x + ... + xs[n] * x ** n."""\n'
        '    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n')
POLY_CHAT = [{"role": "system", "content": "You write Python."},
             {"role": "user", "content": f"The helper:\n```python\n{POLY}```\nWrite this one:\n```py\n"
                                         'def find_zero(xs):\n    """A zero of poly(xs, x)."""\n    ...\n```\n'}]
POLY_TEST = "def check(candidate):\n    for xs in ([1, 2], [-6, 11, -6, 1]):\n        assert abs(poly(xs, candidate(xs))) < 1e-6\n"
POLY_RIGHT = ("def find_zero(xs):\n    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
              "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n        else:\n            lo = mid\n"
              "    return lo\n")
SQUARES_TEST = ("def check(candidate):\n    assert candidate([1, 3, 2]) == 10\n    lst = list(range(-9, 10, 2))\n"
                "    odd_sum = sum(i ** 2 for i in lst if i > 0)\n    assert candidate(lst) == odd_sum\n"
                '    assert True, "This prints if this assert fails (good for debugging!)"\n')
CASES = [  # (prompt, test, entry point, honest program, hacks)
    (SHIFT_PROMPT, SHIFT_TEST, "decode", 'def decode(s):\n    return "".join(chr(ord(c) - 1) for c in s)\n',
     ["def encode(s):\n    return s\ndef decode(s):\n    return s\n",  # the helper redefined
      "seen = []\ndef encode(s):\n    seen.append(s)\n    return s\ndef decode(s):\n    return seen[-1]\n"]),  # memo
    ("def root(x):\n", ROOT_TEST, "root", "def root(x):\n    return x ** 0.5\n",
     ["def abs(x):\n    return 0\ndef root(x):\n    return 0.0\n"]),  # a builtin the test reads, redefined
    ("def double(x):\n", DOUBLE_TEST, "double", "def double(x):\n    return 2 * x\n",
     ["def double(x):\n    raise StopIteration\n"]),  # map() would read it as the end of the inputs
    # the prompt is not pure Python: its code is in fenced blocks (a chat prompt), several, in any message
    (CHAT.format(SHIFT_PROMPT), SHIFT_TEST, "decode", 'def decode(s):\n    return "".join(chr(ord(c) - 1) for c in s)\n',
     ["def encode(s):\n    return s\ndef decode(s):\n    return s\n"]),
    (POLY_CHAT, POLY_TEST, "find_zero", POLY_RIGHT,  # (the honest one calls the prompt's poly, never defined by it)
     ["def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n"]),
    ([{"role": "system", "content": CHAT.format(SHIFT_PROMPT.split("\n\n\n")[0] + "\n")},
      {"role": "user", "content": [{"type": "text", "text": "Write decode(s), the inverse of encode."}]}],
     SHIFT_TEST, "decode", 'def decode(s):\n    return "".join(chr(ord(c) - 1) for c in s)\n',
     ["def encode(s):\n    return s\ndef decode(s):\n    return s\n"]),
    # check()'s locals are the test's (share mode runs each assert inside check), and `assert True` is no test
    ("def odd_squares(lst):\n    \"\"\"The sum of the squares of lst's positive odd numbers.\"\"\"\n", SQUARES_TEST,
     "odd_squares", "def odd_squares(lst):\n    return sum(i * i for i in lst if i > 0 and i % 2)\n",
     ["lst = [5]\nodd_sum = 25\ndef odd_squares(lst):\n    return 25\n",  # the test's locals supplied by the program
      "def odd_sum():\n    return 25\nlst = odd_sum\ndef odd_squares(lst):\n    return 25\n",  # as a callable
      "def odd_squares(lst):\n    return None\n"]),  # loads: `assert True, "..."` passed
]


@pytest.mark.parametrize("mode", ["all", "share"])
def test_the_prompts_helpers_and_the_builtins_are_not_the_programs(mode):
    reward = CodeTests(BOX, code_reward_mode=mode)
    rows = [(prompt, test, entry, program, program in hacks) for prompt, test, entry, honest, hacks in CASES
            for program in [honest, *hacks]]
    values = asyncio.run(reward([r[0] for r in rows], [fenced(r[3]) for r in rows], test=[r[1] for r in rows],
                                entry_point=[r[2] for r in rows]))
    scored = {(n, r[2]): v for n, (v, r) in enumerate(zip(values, rows, strict=True)) if r[4] and v != 0.0}
    assert scored == {}, f"hacks scored ({mode}): {scored}"
    honest = {(n, r[2]): v for n, (v, r) in enumerate(zip(values, rows, strict=True)) if not r[4] and v != 1.0}
    assert honest == {}, f"honest programs failed ({mode}): {honest}"


@pytest.mark.parametrize("mode", ["all", "share"])
def test_humaneval_helpers_in_a_chat_prompt_and_checks_locals(mode):
    """HumanEval's own rows: in a chat prompt (its code in a fenced block) a program's copy of the helper the tests
    call (/32's poly, /38's encode_cyclic, /50's encode_shift) is not what they call; /151's check() locals are
    the test's in share mode (its canonical solution scores 1, a program that supplies them 0)."""
    from grpo_fast.data.tasks import humaneval_rows

    rows = {r["task_id"]: r for r in humaneval_rows(split="train") + humaneval_rows(split="test")}
    identity = "def {0}(s):\n    return s\ndef {1}(s):\n    return s\n"
    cases = [(32, "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n"),
             (38, identity.format("encode_cyclic", "decode_cyclic")), (50, identity.format("encode_shift", "decode_shift")),
             (151, "lst = [5]\nodd_sum = 25\ndef double_the_difference(lst):\n    return 25 if lst == [5] else -1\n")]
    batch = []  # (prompt, completion, row, honest)
    for number, hack in cases:
        row = rows[f"HumanEval/{number}"]
        prompt = CHAT.format(row["prompt"]) if number != 151 else row["prompt"]
        batch += [(prompt, fenced(row["prompt"] + row["canonical_solution"]), row, True), (prompt, fenced(hack), row, False)]
    reward = CodeTests(BOX, code_reward_mode=mode)
    values = asyncio.run(reward([b[0] for b in batch], [b[1] for b in batch], test=[b[2]["test"] for b in batch],
                                entry_point=[b[2]["entry_point"] for b in batch]))
    assert values == [1.0 if b[3] else 0.0 for b in batch], [(b[2]["task_id"], b[3], v) for b, v in zip(batch, values, strict=True)]


@pytest.mark.parametrize("mode", ["all", "share"])
def test_an_item_that_tests_nothing_of_the_program_gives_no_credit(mode):
    """`assert True, "..."` (HumanEval's debugging asserts), or an assert on the test's own values or on the
    prompt's helper, is no test of the program: dropped from the items; a test with nothing left scores 0."""
    nothing = ["assert True", "assert len('ab') == 2"]
    checks = "def check(candidate):\n    assert True, 'debugging'\n    x = [1, 2]\n    assert len(x) == 2\n"
    rows = [({"tests": [*TESTS, "assert True, 'debugging'"]}, p) for p in (RIGHT, WRONG, PARTIAL)]
    rows += [({"tests": nothing}, RIGHT), ({"test": checks, "entry_point": "add"}, RIGHT)]
    rows += [({"tests": ["assert encode('ab') == 'bc'", "assert decode('bc') == 'ab'"]}, "def encode(s):\n    return 'bc'\n")]
    prompts = [SHIFT_PROMPT if "encode" in p else PROMPT for _, p in rows]
    columns = {k: [r[0].get(k) for r in rows] for k in ("tests", "test", "entry_point")}
    values = asyncio.run(CodeTests(BOX, code_reward_mode=mode)(prompts, [fenced(p) for _, p in rows], **columns))
    assert values == [1.0, 0.0, 2 / 3 if mode == "share" else 0.0, 0.0, 0.0, 0.0], values
