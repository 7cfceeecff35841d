"""Eager validation of a TrainConfig: every bad value names itself and the allowed ones."""

from __future__ import annotations

from typing import Any

__all__ = ["validate_config"]


def _int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _num(name: str, value: Any, low: float, *, strict: bool = False, none: bool = False) -> None:
    if value is None and none:
        return
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and (value > low if strict else value >= low)
    )
    if not ok:
        rel = ">" if strict else ">="
        raise ValueError(
            f"{name} must be a number {rel} {low}{' or None' if none else ''}, got {value!r}"
        )


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")


def _dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a table (dict), got {type(value).__name__}")


def validate_config(cfg: Any) -> None:
    """Raise ValueError/TypeError for the first bad field of ``cfg`` (a TrainConfig)."""
    from precisionlab.mixed.loss_scale import parse_loss_scale
    from precisionlab.mixed.policy import FP32_OPS, get_policy, parse_dtype
    from precisionlab.mixed.storage import Storage
    from precisionlab.train.config import DIVERGENCE_ACTIONS, UPDATE_ROUNDINGS
    from precisionlab.train.data import DATASETS
    from precisionlab.train.models import MODELS
    from precisionlab.train.optim import OPTIMIZERS, SCHEDULES

    _choice("model", cfg.model, MODELS)
    _choice("data", cfg.data, DATASETS)
    _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    _choice("schedule", cfg.schedule, SCHEDULES)
    _choice("update_rounding", cfg.update_rounding, UPDATE_ROUNDINGS)
    _choice("divergence_action", cfg.divergence_action, DIVERGENCE_ACTIONS)
    for name in ("model_kwargs", "data_kwargs", "optimizer_kwargs", "loss_scale_kwargs"):
        _dict(name, getattr(cfg, name))
    _num("lr", cfg.lr, 0.0, strict=True)
    _int("warmup_steps", cfg.warmup_steps, 0)
    _num("weight_decay", cfg.weight_decay, 0.0)
    _num("grad_clip", cfg.grad_clip, 0.0, strict=True, none=True)
    if not isinstance(cfg.policy, str):
        raise TypeError(f"policy must be a string, got {type(cfg.policy).__name__}")
    if cfg.fp32_ops is not None:
        if not isinstance(cfg.fp32_ops, tuple | list):
            raise TypeError(f"fp32_ops must be a list of op names; allowed: {', '.join(FP32_OPS)}")
    get_policy(cfg.policy, fp32_ops=cfg.fp32_ops)
    parse_loss_scale(cfg.loss_scale, **cfg.loss_scale_kwargs)
    Storage(
        params=cfg.params_dtype,
        grads=cfg.grads_dtype,
        opt_state=cfg.opt_state_dtype,
        update=cfg.update_rounding,
    )
    if cfg.allreduce_dtype is not None:
        parse_dtype(cfg.allreduce_dtype)
    _int("steps", cfg.steps, 1)
    _int("seed", cfg.seed, 0)
    _int("batch_size", cfg.batch_size, 1)
    _int("microbatches", cfg.microbatches, 1)
    if cfg.batch_size % cfg.microbatches:
        raise ValueError(
            f"batch_size {cfg.batch_size} is not divisible by microbatches {cfg.microbatches}"
        )
    for name in ("eval_interval", "checkpoint_interval", "hist_interval", "shadow_interval"):
        _int(name, getattr(cfg, name), 0)
    _int("eval_batches", cfg.eval_batches, 1)
    _num("divergence_k", cfg.divergence_k, 1.0, strict=True, none=True)
    for name in ("enforce_numerics", "shadow", "data_parallel", "remat", "report_leaves"):
        if not isinstance(getattr(cfg, name), bool):
            raise TypeError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.progress is not None and not isinstance(cfg.progress, bool):
        raise TypeError(f"progress must be true, false or absent, got {cfg.progress!r}")
    if cfg.schedule != "constant" and cfg.steps <= cfg.warmup_steps:
        raise ValueError(f"schedule {cfg.schedule!r} needs steps > warmup_steps")
