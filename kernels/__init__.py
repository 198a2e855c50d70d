"""Triton kernels (installed as `grpo_fast.kernels`). Import needs the `triton` package."""
