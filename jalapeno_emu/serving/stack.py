"""The serving stack's own costs: what the host does around every engine step and every request.

Stage: serving, beside the simulator that applies them (:func:`jalapeno_emu.serving.simulate`).
InferenceX measures end to end through a real serving stack (vLLM, SGLang, TensorRT-LLM, Dynamo):
an HTTP server, a tokenizer and a Python scheduler run on the host around the device's work. A
:class:`StackProfile` holds those costs; the device's own time (kernels, launches, collectives)
stays with the step model, and how launches join into programs stays with the chip's
``software.fusion``.

The model, per engine step with ``n`` sequences running:

- host time ``h = host_step_s + host_s_per_sequence x n`` (scheduling, preparing the inputs,
  processing the outputs); a share ``overlap`` of it runs while the device runs the previous step
  (SGLang's and TensorRT-LLM's overlap schedulers), the rest between steps. The step takes
  ``max(device + sampling_s + (1 - overlap) h, h)``: the host can hide behind the device, never
  the reverse;

and per request:

- before it can be scheduled: ``request_s`` (HTTP, parsing, queueing in the server) plus
  ``tokenize_s_per_token`` per prompt token;
- after a token leaves the device, ``response_s`` (detokenization and the streamed HTTP chunk)
  before the client has it: TTFT and E2E both include it, and a closed-loop client sends its next
  request when it has its last token.

Every number is ``public`` (its source) or ``assumed`` (a one-line reason), as the chip specs'
are. The assumed ones are calibration knobs, to be fitted per stack family on measured points;
nothing here was tuned to make a prediction look right.

Stacks: ``vllm``, ``sglang``, ``trtllm``, ``dynamo`` (NVIDIA Dynamo: a frontend and router in
front of a TensorRT-LLM, vLLM or SGLang backend; the data's rows run TensorRT-LLM behind it) and
``jalapeno`` (the stack of the Jalapeño disclosure, not described in public). Each chip preset
names its default (``software.stack``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from jalapeno_emu.chip.spec import STACK_NAMES, Provenance
from jalapeno_emu.errors import InvalidArgumentError

__all__ = ["STACKS", "StackProfile", "load_stack", "stack_for_framework"]

_UNITS = {"host_step_s": "s", "host_s_per_sequence": "s", "overlap": "", "sampling_s": "s",
          "request_s": "s", "tokenize_s_per_token": "s", "response_s": "s"}
_DOCS = {
    "host_step_s": "host time per engine step: scheduling, input preparation, output processing",
    "host_s_per_sequence": "host time per running sequence per step",
    "overlap": "share of the host's step time hidden behind the device's previous step",
    "sampling_s": "device time per step to sample the next tokens from the logits",
    "request_s": "per request before scheduling: HTTP, parsing, the server's queue",
    "tokenize_s_per_token": "tokenizing one prompt token",
    "response_s": "from a token leaving the device to the client: detokenization, streamed HTTP",
}


@dataclass(frozen=True)
class StackProfile:
    """One serving stack's costs (units in the names; see the module docstring for the model).

    Attributes:
        name: ``vllm``, ``sglang``, ``trtllm``, ``dynamo`` or ``jalapeno``.
        description: what it is.
        host_step_s, host_s_per_sequence, overlap, sampling_s, request_s, tokenize_s_per_token,
            response_s: the costs.
        provenance: field -> :class:`~jalapeno_emu.chip.spec.Provenance`.
    """

    name: str
    description: str
    host_step_s: float
    host_s_per_sequence: float
    overlap: float
    sampling_s: float
    request_s: float
    tokenize_s_per_token: float
    response_s: float
    provenance: dict[str, Provenance]

    def __post_init__(self) -> None:
        for key in _UNITS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise InvalidArgumentError(f"stack {self.name}: {key} must be a number >= 0, found {value!r}")
            if key not in self.provenance:
                raise InvalidArgumentError(f"stack {self.name}: {key} has no provenance")
        if self.overlap > 1:
            raise InvalidArgumentError(f"stack {self.name}: overlap must be in [0, 1], found {self.overlap}")

    def host_s(self, sequences: int) -> float:
        """Host time of a step with ``sequences`` running, s."""
        return self.host_step_s + self.host_s_per_sequence * sequences

    def step_s(self, device_s: Any, sequences: int) -> Any:
        """A step's wall time from its device time (a float, or an array of them), s."""
        host = self.host_s(sequences)
        exposed = device_s + self.sampling_s + (1.0 - self.overlap) * host
        return np.maximum(exposed, host) if isinstance(exposed, np.ndarray) else max(exposed, host)

    def request_in_s(self, prompt_tokens: int) -> float:
        """Host time before a request of ``prompt_tokens`` can be scheduled, s."""
        return self.request_s + self.tokenize_s_per_token * prompt_tokens

    def rows(self) -> list[dict[str, Any]]:
        """One dict per cost: field, value, unit, provenance kind, note, what it is (``stack show``)."""
        return [{"field": key, "value": getattr(self, key), "unit": _UNITS[key],
                 "kind": self.provenance[key].kind, "note": self.provenance[key].note, "doc": _DOCS[key]}
                for key in _UNITS]

    def as_dict(self) -> dict[str, Any]:
        """JSON form: name, description and each cost with its provenance."""
        costs = {r["field"]: {"value": r["value"], "kind": r["kind"], "note": r["note"]} for r in self.rows()}
        return {"name": self.name, "description": self.description, **costs}


def _a(note: str) -> Provenance:
    return Provenance(kind="assumed", note=note)


def _p(note: str) -> Provenance:
    return Provenance(kind="public", note=note)


_SGLANG_OVERLAP = ("SGLang v0.4's zero-overhead batch scheduler runs one batch ahead, overlapping CPU "
                   "scheduling with the GPU (on by default; Nsight shows no GPU idle between decode "
                   "batches): https://lmsys.org/blog/2024-12-04-sglang-v0-4/#zero-overhead-batch-scheduler")
_TRT_OVERLAP = ("TensorRT-LLM's overlap scheduler, enabled by default, launches step n+1 before the CPU "
                "work of step n: https://nvidia.github.io/TensorRT-LLM/latest/features/overlap-scheduler.html")
_HOST_STEP = _a("calibration knob: the order of a Python engine's per-step scheduling, input preparation "
                "and output processing for a small batch (vLLM's v0.5.3 profile put scheduling at 29 % of a "
                "Llama-3-8B step on an H100: https://blog.vllm.ai/2024/09/05/perf-update.html)")
_PER_SEQ = _a("calibration knob: per running sequence, the scheduler's bookkeeping and the per-request "
              "input and output tensors a Python engine builds each step")
_SAMPLING = _a("calibration knob: a few kernels (softmax, top-k/top-p, the draw) over the vocabulary per "
               "step at CUDA-graph launch cost")
_REQUEST = _a("calibration knob: an OpenAI-compatible HTTP request parsed and queued in the same host "
              "(InferenceX's client and server share the node)")
_TOKENIZE = _a("calibration knob: Rust tokenizers (Hugging Face tokenizers, tiktoken) run at the order of "
               "a million tokens per second per core")
_RESPONSE = _a("calibration knob: incremental detokenization of a token and one streamed HTTP chunk")


def _stack(name: str, description: str, **values: tuple[float, Provenance]) -> StackProfile:
    return StackProfile(name=name, description=description, **{k: v[0] for k, v in values.items()},
                        provenance={k: v[1] for k, v in values.items()})


_COMMON: dict[str, tuple[float, Provenance]] = {
    "host_step_s": (5e-4, _HOST_STEP), "host_s_per_sequence": (2e-6, _PER_SEQ),
    "sampling_s": (1e-5, _SAMPLING), "request_s": (1e-3, _REQUEST),
    "tokenize_s_per_token": (1e-6, _TOKENIZE), "response_s": (2e-4, _RESPONSE),
}
"""What the stacks share where nothing tells them apart (the differences are below)."""
_NOT_PUBLIC = _a("nothing public: the GPU stacks' figure, a knob for anyone who knows")

STACKS: dict[str, StackProfile] = {
    "vllm": _stack(
        "vllm", "vLLM (V1 engine): an API server process and an engine-core busy loop", **{
            **_COMMON, "overlap": (0.0, _a(
                "calibration knob: the V1 engine core schedules between device steps unless "
                "--async-scheduling is set, and InferenceX's vLLM settings are not in the data"))}),
    "sglang": _stack(
        "sglang", "SGLang: a tokenizer manager, a scheduler one batch ahead of the GPU, a detokenizer",
        **{**_COMMON, "overlap": (1.0, _p(_SGLANG_OVERLAP))}),
    "trtllm": _stack(
        "trtllm", "TensorRT-LLM (PyTorch backend): a Python executor with the overlap scheduler",
        **{**_COMMON, "overlap": (1.0, _p(_TRT_OVERLAP))}),
    "dynamo": _stack(
        "dynamo", "NVIDIA Dynamo: a frontend and KV-aware router in front of TensorRT-LLM workers", **{
            **_COMMON, "overlap": (1.0, _p(_TRT_OVERLAP)),
            "request_s": (2e-3, _a("calibration knob: the HTTP request of the other stacks plus one more "
                                   "hop, frontend to router to worker")),
            "response_s": (4e-4, _a("calibration knob: the other stacks' response plus the hop back "
                                    "through the frontend"))}),
    "jalapeno": _stack(
        "jalapeno", "the stack of the Jalapeño disclosure: OpenAI's own serving software (not public)", **{
            **{k: (v, _NOT_PUBLIC) for k, (v, _) in _COMMON.items()},
            "tokenize_s_per_token": _COMMON["tokenize_s_per_token"],
            "overlap": (1.0, _a("a stack built with its chip schedules ahead of the device, as SGLang and "
                                "TensorRT-LLM do"))}),
}
assert tuple(STACKS) == STACK_NAMES  # the chip spec's check knows the names without importing this
assert all(set(s.provenance) == set(_UNITS) for s in STACKS.values())
assert [f.name for f in fields(StackProfile)][2:-1] == list(_UNITS)


def load_stack(name: str | StackProfile) -> StackProfile:
    """The stack called ``name`` (a StackProfile is returned as it is).

    Raises:
        InvalidArgumentError: no such stack (the message lists them).
    """
    if isinstance(name, StackProfile):
        return name
    stack = STACKS.get(str(name).strip().lower())
    if stack is None:
        raise InvalidArgumentError(f"stack {name!r} is not one of {', '.join(STACKS)}")
    return stack


def stack_for_framework(framework: str) -> str | None:
    """The stack of a measured row's ``framework`` text (``"vllm v0.17.0 ROCm, TP8"``,
    ``"dynamo-trt (disagg)"``, ``"mori-sglang"``, ``"trt (single node)"``), or None when the text
    names none of them (``"atom"``, ``"unstated"``)."""
    text = framework.lower()
    if "unstated" in text or "likely" in text:
        return None
    for key, stack in (("dynamo", "dynamo"), ("sglang", "sglang"), ("vllm", "vllm"), ("trt", "trtllm")):
        if key in text:
            return stack
    return None
