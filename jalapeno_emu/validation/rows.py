"""How each measured point is predicted: its preset, model config, weight formats, mapping and class.

Stage: validation, between the CSV (:mod:`~jalapeno_emu.validation.points`) and the predictions.

Classes (:data:`CLASSES`):

- ``fit``: predicted and used to calibrate the GPU knobs;
- ``predicted-only``: predicted on one aggregated 8-GPU domain and reported, not fitted, because
  the run is something we do not model: disaggregated serving (prefill and decode on separate
  nodes), multi-token prediction on, or weights the kernels cannot read in that format (FP8
  experts: the MoE kernel reads MXFP4 experts only);
- ``not-predicted``: no concurrency in the source, no preset or model config for the row, or the
  prediction failed (the kernel's refusal or the FitError, in one line).

Formats (stated per row in ``format_note``): NVFP4 and INT4 W4A16 expert weights run as MXFP4,
the closest format the kernels take (4-bit elements; 32-element blocks with an E8M0 scale instead
of NVFP4's 16-element blocks with E4M3 scales, or INT4's per-group scales); FP8 is MXFP8
(``fp8e4``) for every weight, the gemm kernel's FP8 path.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from jalapeno_emu.model.config import ModelConfig, load_model_config
from jalapeno_emu.serving.speculative import Speculation, speculation
from jalapeno_emu.serving.stack import stack_for_framework
from jalapeno_emu.validation.points import MeasuredPoint

__all__ = ["CLASSES", "RowPlan", "model_config", "plan_row"]

CLASSES = ("fit", "predicted-only", "not-predicted")

_PRESETS = {"B200": "b200", "H100": "h100", "H200": "h200", "MI300X": "mi300x", "MI325X": "mi325x",
            "MI355X": "mi355x"}
_MODELS = {"DeepSeek-R1-0528": "deepseek-r1", "Kimi-K2.5": "kimi-k2.5", "gpt-oss-120b": "gpt-oss-120b"}
_TP8 = re.compile(r"\bTP8\b", re.IGNORECASE)


@dataclass(frozen=True)
class RowPlan:
    """What a measured point is predicted as.

    Attributes:
        point: the measured point.
        preset: the chip preset (None: none matches the hardware).
        model: the model config name (None: none matches).
        expert_weight_fmt, weight_fmt: the formats the config is replaced with.
        mapping: ``"tp=8"`` where the source states TP8 (None: the best mapping is searched).
        cls: one of :data:`CLASSES` before predicting (a failed prediction demotes it).
        reasons: why it is not ``fit`` (empty for fit rows).
        hardware_note: the row's own caveat on the hardware ("" when none).
        format_note: how the precision maps to the kernels' formats.
        stack: the serving stack its framework names (None: the preset's own, the framework
            naming none of them).
        speculation: the MTP it is predicted with where the data says MTP was on (not how many
            draft tokens: 1 at the default acceptance unless ``run_validation`` is given another);
            None when off or unknown.
    """

    point: MeasuredPoint
    preset: str | None
    model: str | None
    expert_weight_fmt: str
    weight_fmt: str
    mapping: str | None
    cls: str
    reasons: tuple[str, ...]
    hardware_note: str
    format_note: str
    stack: str | None = None
    speculation: Speculation | None = None


def _preset(hardware: str) -> tuple[str | None, str]:
    """(preset, caveat) of a hardware cell: 'B200 (8-GPU node; ...)' -> b200 with its parenthesis;
    "NVIDIA (label 'nv1126'; most likely B200 ...)" -> b200, caveat that the source does not say."""
    head = hardware.split("(")[0].strip()
    caveat = hardware[len(head):].strip().strip("()")
    if head in _PRESETS:
        return _PRESETS[head], caveat
    if head == "NVIDIA" and "B200" in hardware:
        return "b200", f"hardware not stated by the source: {caveat}"
    return None, caveat


def _formats(precision: str, cfg_weight_fmt: str) -> tuple[str, str, str, bool]:
    """(expert fmt, other weights fmt, note, expressible) for a precision cell."""
    p = precision.upper()
    if "INT4" in p:
        note = "INT4 W4A16 experts run as MXFP4 (closest 4-bit format the kernels take)"
        return "fp4", cfg_weight_fmt, note, True
    if "NVFP4" in p or (p.startswith("FP4") and "MXFP4" not in p):
        note = "FP4 (NVFP4 on NVIDIA) experts as MXFP4 (closest: 32- vs 16-element blocks, E8M0 vs E4M3)"
        return "fp4", cfg_weight_fmt, note, True
    if "FP4" in p:
        return "fp4", cfg_weight_fmt, "MXFP4 experts, as served", True
    if "FP8" in p:
        note = ("FP8 -> MXFP8 for every weight; the MoE kernel reads MXFP4 experts only, so expert reads are "
                "timed at MXFP4 bytes")
        return "fp8e4", "fp8e4", note, False
    return "fp4", cfg_weight_fmt, f"precision {precision!r} not recognised", False


def plan_row(point: MeasuredPoint) -> RowPlan:
    """The :class:`RowPlan` of ``point`` (no prediction is run)."""
    preset, hw_note = _preset(point.hardware)
    model = _MODELS.get(point.model)
    base_fmt = load_model_config(model).weight_fmt if model else "bf16"
    expert_fmt, weight_fmt, fmt_note, expressible = _formats(point.precision, base_fmt)
    where = " ".join((point.hardware, point.framework, point.notes))
    mapping = "tp=8" if _TP8.search(where) else None
    blocking, soft = [], []
    if preset is None:
        blocking.append(f"no preset for hardware {point.hardware!r}")
    if model is None:
        blocking.append(f"no model config for {point.model!r}")
    if point.concurrency is None:
        blocking.append("the source gives no concurrency")
    if not point.measured():
        blocking.append("no compared metric (tok_s_user, tput_per_gpu, ttft_s) is measured")
    if "disagg" in point.framework.lower():
        soft.append("disaggregated serving (prefill and decode on separate nodes): predicted as one "
                    "aggregated 8-GPU domain")
    mtp_on = point.mtp.lower().startswith("on")
    if mtp_on:
        soft.append("multi-token prediction on, its draft tokens and acceptance not in the data: predicted "
                    "with the MTP of validate's --mtp (default 1 draft token at the default acceptance)")
    if not expressible:
        soft.append(fmt_note)
    cls = "not-predicted" if blocking else "predicted-only" if soft else "fit"
    return RowPlan(point, preset, model, expert_fmt, weight_fmt, mapping, cls, tuple(blocking + soft),
                   hw_note, fmt_note, stack_for_framework(point.framework),
                   speculation(1) if mtp_on else None)


def model_config(plan: RowPlan) -> ModelConfig:
    """The row's model config with its weight formats (``dataclasses.replace``)."""
    assert plan.model is not None
    cfg = load_model_config(plan.model)
    return dataclasses.replace(cfg, expert_weight_fmt=plan.expert_weight_fmt, weight_fmt=plan.weight_fmt)
