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
