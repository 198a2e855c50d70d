"""grpo_fast/compat.py is the one place that reaches torch's and transformers' internals: nothing else in the
package names them, and each shim still reaches what it needs in the installed versions."""

import re
from pathlib import Path

import torch

from grpo_fast import compat

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_fast"
# the internals the shims wrap (a docstring or a comment may name one: code and one-line strings are scanned)
INTERNALS = re.compile(r"torch\._C\._|torch\._disable_dynamo\(|_get_fsdp_state\(|torch\.cpu\._is_|\b_attn_implementation\b")


TRIPLE = ('"""', "'''")


def _code_lines(path: Path) -> list[str]:
    import io
    import tokenize

    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type != tokenize.COMMENT and not tok.string.startswith(TRIPLE):
            out.append((tok.start[0], tok.string))
    lines: dict = {}
    for row, text in out:
        lines[row] = lines.get(row, "") + text
    return list(lines.values())


def test_only_the_compat_module_reaches_torch_and_transformers_internals():
    offenders = {str(p.relative_to(PACKAGE)): hits for p in sorted(PACKAGE.rglob("*.py"))
                 if p.name != "compat.py" and (hits := [line for line in _code_lines(p) if INTERNALS.search(line)])}
    assert not offenders, f"torch/transformers internals outside grpo_fast/compat.py: {offenders}"
    assert any(INTERNALS.search(line) for line in _code_lines(PACKAGE / "compat.py")), "the scan must see the shims"


def test_each_shim_reaches_what_it_needs():
    x = torch.ones(3, requires_grad=True)
    with torch.no_grad(), compat.autograd_inside_custom_op():  # (grad mode back on inside)
        y = (x * x).sum()
    assert y.requires_grad and torch.autograd.grad(y, x)[0].tolist() == [2.0, 2.0, 2.0]
    assert compat.disable_dynamo(lambda t: t + 1)(torch.zeros(1)).item() == 1.0
    assert isinstance(compat.cpu_has_bf16_matmul(), bool)
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=16,
                         num_hidden_layers=1, vocab_size=16)
    compat.set_attention_implementation(config, "sdpa")
    assert compat.attention_implementation(config) == "sdpa"
