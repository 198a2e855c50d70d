"""Comparison helpers: failures say where and by how much, not just "not close"."""

from __future__ import annotations

import torch


def assert_close(actual, expected, *, atol: float, rtol: float = 0.0, name: str = "value") -> None:
    """Like torch.testing.assert_close, reporting mismatch count, worst index and worst values."""
    actual = torch.as_tensor(actual).detach().double().cpu()
    expected = torch.as_tensor(expected).detach().double().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    bad = ~(err <= bound)  # NaN counts as a mismatch
    if bad.any():
        worst = int(torch.where(bad, err.nan_to_num(float("inf")), -1.0).reshape(-1).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape)) if actual.dim() else ()
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{actual.numel()} elements differ beyond atol={atol}, rtol={rtol}; "
            f"worst at {idx}: got {actual.reshape(-1)[worst].item():.6g}, expected {expected.reshape(-1)[worst].item():.6g} "
            f"(|diff| {err.reshape(-1)[worst].item():.3g}); max |diff| {err.nan_to_num(float('inf')).max().item():.3g}"
        )


def magnitude(expected) -> float:
    """max(1, largest |expected|): what a tolerance stated for values of order 1 is multiplied by.
    fp32 rounding and summation-order error grow with the values compared (an ulp of 4.8 is 5e-7),
    so no bound on values of unbounded size may be absolute only."""
    expected = torch.as_tensor(expected).detach().double()
    return max(1.0, float(expected.abs().max())) if expected.numel() else 1.0


def scaled(atol: float, expected) -> float:
    """`atol` stated for values of order 1, scaled to the magnitude of `expected`."""
    return atol * magnitude(expected)


def plain_bound(expected, plain, *, factor: float = 4.0, floor: float) -> float:
    """`factor` x the error plain PyTorch makes (`plain`: the same computation in the input dtype,
    against the float64 `expected`) + `floor` x (1 + max |expected|). Both terms scale with the
    values: the first is measured on them, the second is relative to their size."""
    expected, plain = torch.as_tensor(expected).detach().double().cpu(), torch.as_tensor(plain).detach().double().cpu()
    if expected.numel() == 0:
        return floor
    plain_err = float((plain - expected).abs().max())
    return factor * plain_err + floor * (1.0 + float(expected.abs().max()))
