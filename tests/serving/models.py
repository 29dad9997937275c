"""Step-time models for the serving tests."""

from __future__ import annotations

from dataclasses import dataclass

from jalapeno_emu.serving.step_model import StepWork
from jalapeno_emu.serving.synthetic import LinearStepModel, RooflineStepModel


@dataclass(frozen=True)
class NoStretch:
    """Wraps a model, hiding its decode_stretch_times_s: the simulator then prices steps one by one."""

    inner: object

    @property
    def name(self):
        return self.inner.name

    @property
    def chips(self):
        return self.inner.chips

    @property
    def kv_capacity_tokens(self):
        return self.inner.kv_capacity_tokens

    @property
    def max_batch_tokens(self):
        return self.inner.max_batch_tokens

    def step_time_s(self, work: StepWork) -> float:
        return self.inner.step_time_s(work)


@dataclass
class Recording:
    """Wraps a model and records every StepWork it is asked to price."""

    inner: object
    works: list

    def __init__(self, inner):
        self.inner = inner
        self.works = []
        self.name = inner.name
        self.chips = inner.chips
        self.kv_capacity_tokens = inner.kv_capacity_tokens
        self.max_batch_tokens = inner.max_batch_tokens

    def step_time_s(self, work: StepWork) -> float:
        self.works.append(work)
        return self.inner.step_time_s(work)


def linear(**kw) -> LinearStepModel:
    args = dict(name="lin", chips=1, kv_capacity_tokens=1_000_000, max_batch_tokens=4096, fixed_s=1e-3,
                decode_s_per_sequence=2e-5, decode_s_per_context_token=1e-9, prefill_s_per_token=1e-6)
    args.update(kw)
    return LinearStepModel(**args)


def roofline(**kw) -> RooflineStepModel:
    args = dict(name="roof", chips=4, kv_capacity_tokens=200_000, max_batch_tokens=2048, flops_per_s=4e15,
                bytes_per_s=2e13, weight_bytes=6e10, flops_per_token=1e10, kv_bytes_per_token=4e4,
                attention_flops_per_pair=3e5, overhead_s=2e-5)
    args.update(kw)
    return RooflineStepModel(**args)
