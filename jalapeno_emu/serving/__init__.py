"""Serving: continuous batching of a deployment's step-time model into InferenceX metrics.

Stage: serving, after the rack model and before the CLI. A :class:`StepTimeModel` prices one engine
step; :func:`simulate` serves a closed-loop ISL/OSL workload at one concurrency; :func:`sweep` runs
many (mapping, concurrency) points; :func:`pareto_front` and :func:`plot_pareto` give the
InferenceX-style interactivity-versus-throughput frontier; the writers save points as CSV/JSON.
"""

from jalapeno_emu.serving.metrics import POWER_KINDS as POWER_KINDS
from jalapeno_emu.serving.metrics import ServingMetrics as ServingMetrics
from jalapeno_emu.serving.metrics import Stats as Stats
from jalapeno_emu.serving.metrics import power_w_from_spec as power_w_from_spec
from jalapeno_emu.serving.output import SCHEMA_VERSION as SCHEMA_VERSION
from jalapeno_emu.serving.output import read_points_json as read_points_json
from jalapeno_emu.serving.output import write_points_csv as write_points_csv
from jalapeno_emu.serving.output import write_points_json as write_points_json
from jalapeno_emu.serving.pareto import pareto_front as pareto_front
from jalapeno_emu.serving.pareto import pareto_fronts as pareto_fronts
from jalapeno_emu.serving.pareto import peak_point as peak_point
from jalapeno_emu.serving.pareto import point_value as point_value
from jalapeno_emu.serving.pareto import value_at as value_at
from jalapeno_emu.serving.plot import plot_pareto as plot_pareto
from jalapeno_emu.serving.simulate import default_requests as default_requests
from jalapeno_emu.serving.simulate import simulate as simulate
from jalapeno_emu.serving.step_model import StepTimeModel as StepTimeModel
from jalapeno_emu.serving.step_model import StepWork as StepWork
from jalapeno_emu.serving.step_model import SupportsDecodeStretch as SupportsDecodeStretch
from jalapeno_emu.serving.sweep import SweepPoint as SweepPoint
from jalapeno_emu.serving.sweep import sweep as sweep
from jalapeno_emu.serving.synthetic import LinearStepModel as LinearStepModel
from jalapeno_emu.serving.synthetic import RooflineStepModel as RooflineStepModel

__all__ = [
    "POWER_KINDS",
    "SCHEMA_VERSION",
    "LinearStepModel",
    "RooflineStepModel",
    "ServingMetrics",
    "Stats",
    "StepTimeModel",
    "StepWork",
    "SupportsDecodeStretch",
    "SweepPoint",
    "default_requests",
    "pareto_front",
    "pareto_fronts",
    "peak_point",
    "plot_pareto",
    "point_value",
    "power_w_from_spec",
    "read_points_json",
    "simulate",
    "sweep",
    "value_at",
    "write_points_csv",
    "write_points_json",
]
