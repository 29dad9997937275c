"""Fused layer and step programs: a model's launches composed into one persistent Program.

Stage: model, on top of ``kernels/compose.py``. The operators are exactly the launches of the
plan (``model.plan``: same kernels, same shapes, so the same arithmetic); what changes is how
they are joined:

- ``none``: every launch is its own Program (``model.timing`` sums them, each paying the
  launch cost and its own first load and last store);
- ``layer``: one Program per decoder layer (and one for the head, one for the tail), paying the
  launch cost once; inside it operator boundaries are semaphore edges, activations stay on chip
  and the next operators' weights stream while the current one computes; the layer's input
  comes from HBM and its output goes back there;
- ``step``: one Program for the whole step: embedding, every layer, final norm and logits,
  with the next layer's weights streaming during the current one.

**Where activations live.** In a decode step (few tokens) every activation stays on chip: a
GEMM's output blocks stay in the scratchpad of the core that made them, the next operator
copies what it needs scratchpad to scratchpad. The normalisations before a GEMM compute every
row on every core (``Out.replicated``) when that is cheaper than an exchange (a few vector
passes over ``tokens x hidden`` elements against one DMA set-up), so the GEMMs read their input
in place; above that size the rows are split over the cores and the GEMMs fetch them. A prefill
chunk's activations (MBs) go through HBM, each operator storing its output tile by tile and the
next one loading each tile once it is ready.

**Caches.** ``kv-append`` / ``mla-append`` write the new tokens into the layer's cache in HBM;
the attention operator reads the cache through the append's output, waiting only for the bytes
the append wrote (the rest of the context is prefetched while earlier operators run). In a
decode step ``kv-append`` also keeps the new K and V rows on chip (``Out.onchip()`` for its
caches) and attention-decode takes them from there, so the stores are off its path.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jalapeno_emu.chip import ChipSpec
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Program, Tile
from jalapeno_emu.kernels.compose import Composer
from jalapeno_emu.kernels.emit import Out, TensorRef, emit_copy, emit_store
from jalapeno_emu.kernels.norm import VECTOR_PASSES as NORM_VECTOR_PASSES

from .config import ModelConfig
from .plan import Launch, Step, head_launches, layer_launches, tail_launches

__all__ = ["FUSION_LEVELS", "FusedBuild", "build_fused", "build_part", "check_fusion", "layer_windows",
           "replicate_rows"]

FUSION_LEVELS = ("none", "layer", "step")
"""How launches are joined into Programs (see the module docstring)."""


def check_fusion(fusion: str) -> str:
    """``fusion`` if it is a fusion level; InvalidArgumentError naming the choices otherwise."""
    if fusion not in FUSION_LEVELS:
        raise InvalidArgumentError(f"fusion {fusion!r} is not one of {', '.join(FUSION_LEVELS)}")
    return fusion


def replicate_rows(tokens: int, hidden: int, spec: ChipSpec) -> bool:
    """True when every core computing all ``tokens`` rows of a norm is cheaper than one exchange
    (a DMA set-up): then the GEMMs after it read their input in place."""
    vector_s = NORM_VECTOR_PASSES * tokens * hidden / spec.vector.lanes / spec.core.clock_hz
    return vector_s < spec.dma.setup_latency_s


@dataclass
class FusedBuild:
    """A fused program and what it is made of.

    Attributes:
        program: the Program.
        composer: the composer that built it (operators, values, constants).
        step: what it computes; layers: the decoder layers in it, in order.
        head, tail: it starts with the embedding / ends with final norm and logits.
        ops: operator label -> (layer index: -1 head, ``cfg.layers`` tail; the plan's launch;
            the launch's label in the plan).
        layer_ops: layer index -> its operator labels, in order (-1: head, layers: tail).
        externals: external value name -> its HBM allocation name (inputs the program reads:
            token ids, x and residual of a layer program, zero residual of layer 0).
        results: result name ("logits", or "x" and "residual" of a program without the tail)
            -> its HBM allocation name.
    """

    program: Program
    composer: Composer
    step: Step
    layers: tuple[int, ...]
    head: bool
    tail: bool
    ops: dict[str, tuple[int, Launch]] = field(default_factory=dict)
    layer_ops: dict[int, list[str]] = field(default_factory=dict)
    externals: dict[str, str] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)

    @property
    def consts(self) -> dict[str, Any]:
        """HBM constants the emitters allocated (recorded name -> value)."""
        return self.composer.ctx.consts


def _wiring(cfg: ModelConfig) -> dict[tuple[str, str], tuple[str, str, int, int]]:
    """(launch label, kernel tensor) -> (producer label, its output, first column, columns) for the
    edges inside one decoder layer (columns: the region of the producer's output it reads; 0, 0:
    all of it). Tensors not listed come from outside the layer (x, residual), are joins, or are
    the kernel's own (weights, caches)."""
    wires: dict[tuple[str, str], tuple[str, str, int, int]] = {
        ("ffn_norm", "x"): ("o_proj", "y", 0, 0), ("ffn_norm", "residual"): ("attn_norm", "h", 0, 0),
        ("moe", "x"): ("ffn_norm", "y", 0, 0), ("ffn", "x"): ("ffn_norm", "y", 0, 0),
        ("shared_ffn", "x"): ("ffn_norm", "y", 0, 0), ("o_proj", "x"): ("attention", "out", 0, 0),
        ("logits", "x"): ("final_norm", "y", 0, 0),
    }
    if cfg.attention == "gqa":
        hq, hkv, d = cfg.q_heads, cfg.kv_heads, cfg.head_dim
        q, k, v = (0, hq * d), (hq * d, hkv * d), ((hq + hkv) * d, hkv * d)
        wires |= {("qkv_proj", "x"): ("attn_norm", "y", 0, 0),
                  ("kv_append", "k_new"): ("qkv_proj", "y", *k),
                  ("kv_append", "v_new"): ("qkv_proj", "y", *v),
                  ("attention", "q"): ("qkv_proj", "y", *q), ("attention", "k"): ("qkv_proj", "y", *k),
                  ("attention", "v"): ("qkv_proj", "y", *v),
                  ("attention", "k_cache"): ("kv_append", "k_cache", 0, 0),
                  ("attention", "v_cache"): ("kv_append", "v_cache", 0, 0)}
        return wires
    ql, r, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_dim
    q_cols = ql or cfg.q_heads * (cfg.qk_nope_dim + rope)
    wires |= {("qkv_a_proj", "x"): ("attn_norm", "y", 0, 0),
              ("q_a_norm", "x"): ("qkv_a_proj", "y", 0, ql),
              ("kv_a_norm", "x"): ("qkv_a_proj", "y", q_cols, r),
              ("q_b_proj", "x"): ("q_a_norm", "y", 0, 0),
              ("mla_append", "q"): ("q_b_proj", "y", 0, 0) if ql else ("qkv_a_proj", "y", 0, q_cols),
              ("attention", "q"): ("mla_append", "q_rot", 0, 0),
              ("attention", "kv_cache"): ("mla_append", "kv_cache", 0, 0)}
    return wires


class _Graph:
    """Adds a model's launches to a composer, wiring each one's tensors to earlier outputs
    (``_wiring``); an input whose producer is not in the program is an HBM tensor of its own
    (what a program of part of a layer reads)."""

    def __init__(self, cfg: ModelConfig, step: Step, spec: ChipSpec, comp: Composer, fb: FusedBuild) -> None:
        self.cfg, self.step, self.spec, self.comp, self.fb = cfg, step, spec, comp, fb
        self.decode = step.phase == "decode"
        t = step.tokens
        if self.decode and replicate_rows(t, cfg.hidden, spec):
            self.rep: Out | None = Out.replicated(range(spec.core.count))
        else:
            self.rep = Out.onchip() if self.decode else None
        self.onchip = Out.onchip() if self.decode else None
        self.wires = _wiring(cfg)

    def _op(self, layer: int, label: str) -> str:
        return f"{'head' if layer < 0 else 'tail' if layer >= self.cfg.layers else f'L{layer}'}.{label}"

    def add(self, layer: int, launch: Launch, label: str, inputs: dict[str, str], outputs: dict[str, str],
            outs: dict[str, Out | None] | None = None) -> str:
        op = self._op(layer, label)
        places = {k: v for k, v in (outs or {}).items() if v is not None}
        self.comp.add_kernel(op, launch.kernel, launch.shape_dict, inputs=inputs,
                             outputs={k: f"{op}:{v}" for k, v in outputs.items()}, outs=places)
        self.fb.ops[op] = (layer, launch)
        self.fb.layer_ops.setdefault(layer, []).append(op)
        return op

    def external(self, name: str, shape: tuple[int, int], dtype: str = "bf16") -> str:
        kb = self.comp.kb
        self.comp.value(name, TensorRef.hbm(name, kb.hbm(name, shape, dtype)))
        self.fb.externals[name] = name
        return name

    # --- head and tail -----------------------------------------------------------------------
    def head(self) -> str:
        (emb,) = head_launches(self.cfg, self.step)
        op = self.add(-1, emb, "embedding", {}, {"out": "x"}, {"out": self.onchip})
        return f"{op}:x"

    def tail(self, x: str, residual: str) -> str:
        norm, logits = tail_launches(self.cfg, self.step)
        if not self.decode and self.step.seq > 1:
            x, residual = self._last_rows(x), self._last_rows(residual)
        rows = self.step.batch
        cores = range(self.spec.core.count)
        rep = Out.replicated(cores) if replicate_rows(rows, self.cfg.hidden, self.spec) else Out.onchip()
        n = self.add(self.cfg.layers, norm, "final_norm", {"x": x, "residual": residual},
                     {"y": "y", "h": "h"}, {"y": rep, "h": rep})
        op = self.add(self.cfg.layers, logits, "logits", {"x": f"{n}:y"}, {"y": "logits"})
        self.fb.results["logits"] = f"{op}/y"
        return f"{op}:logits"

    def _last_rows(self, name: str) -> str:
        """Each sequence's last prefill token: rows s-1, 2s-1, ... of an HBM activation."""
        seq, b = self.step.seq, self.step.batch
        out = f"{name}@last"

        def rows(ref: TensorRef) -> TensorRef:
            if not ref.in_hbm:
                raise InvalidArgumentError("prefill activations are expected in HBM")
            base = ref.base
            tile = Tile(base.space, base.core, base.offset + (seq - 1) * base.stride, base.dtype, b,
                        base.cols, base.stride * seq)
            picked = TensorRef.hbm(out, tile)
            for r in ref.waits():  # conservative: wait for whatever readiness the rows have
                picked = picked.with_ready(0, 0, b, base.cols, r)
            return picked

        self.comp.derive(out, (name,), rows)
        return out

    # --- layers ------------------------------------------------------------------------------
    def _placement(self, label: str, output: str) -> Out | None:
        """Where an operator's output goes: on chip in a decode step (a norm before a GEMM
        replicated when that is cheaper than an exchange), HBM in a prefill chunk (None)."""
        if label in ("attn_norm", "ffn_norm", "q_a_norm"):
            return self.rep
        if label == "kv_append":  # the cache in HBM, the new rows also kept on chip (decode)
            return self.onchip
        if label == "mla_append" and output == "kv_cache":
            return None  # the cache, in HBM
        return self.onchip

    def launches(self, layer: int, launches: Sequence[Launch], entry: dict[str, str]) -> dict[str, str]:
        """Add ``launches`` of one layer (all of its plan, or part of it) in order.

        ``entry`` gives the layer's inputs from outside it: "x" and "residual" (attn_norm's). Any
        other input whose producer is not among ``launches`` becomes an HBM tensor of its own.
        Returns the produced values by "label:output".
        """
        from jalapeno_emu.kernels.registry import get_kernel

        produced: dict[str, str] = {}
        labels = {la.label for la in launches}
        kv_a_buf = None
        if not self.decode and {"qkv_a_proj", "kv_a_norm", "mla_append"} <= labels:
            # A prefill chunk's [c_kv | k_pe] rows in HBM: the norm writes the first columns, a copy
            # brings the rope columns of the projection beside them.
            cfg = self.cfg
            shape = (self.step.tokens, cfg.kv_lora_rank + cfg.qk_rope_dim)
            kv_a_buf = self.external(self._op(layer, "kv_a"), shape)
        for la in launches:
            specs = get_kernel(la.kernel).tensors_of(la.shape_dict, self.spec)
            op = self._op(layer, la.label)
            inputs: dict[str, str] = {}
            for ts in specs:
                if ts.role == "output":
                    continue
                key = (la.label, ts.name)
                if ts.role != "input":  # a cache another operator of the layer wrote, or the kernel's own
                    src = self.wires.get(key)
                    if src is not None and f"{src[0]}:{src[1]}" in produced:
                        inputs[ts.name] = produced[f"{src[0]}:{src[1]}"]
                    continue
                if la.label == "attn_norm" and ts.name in entry:
                    inputs[ts.name] = entry[ts.name]
                    continue
                if key == ("mla_append", "kv_a") and {"kv_a_norm:y", "qkv_a_proj:y"} <= set(produced):
                    inputs[ts.name] = self._kv_a(layer, op, produced, kv_a_buf)
                    continue
                src = self.wires.get(key)
                value = produced.get(f"{src[0]}:{src[1]}") if src else None
                if value is None:
                    inputs[ts.name] = self.external(f"{op}.{ts.name}", ts.shape, ts.dtype)
                    continue
                rows = ts.shape[0]
                if src[3] or rows < self.step.tokens:
                    # a column range of the producer (q, k, v of a QKV projection), or the first
                    # rows of it where the consumer takes fewer tokens: a mapping's shared expert
                    # runs on the chip's own t/tp tokens of the t its norm produced
                    view = f"{op}:{ts.name}"
                    self.comp.view(view, value, 0, src[2], rows, src[3] or ts.shape[1])
                    value = view
                inputs[ts.name] = value
            outputs = {ts.name: ts.name for ts in specs if ts.role in ("output", "inout")}
            outs = {name: self._placement(la.label, name) for name in outputs}
            if la.label == "kv_a_norm" and kv_a_buf is not None:
                outs["y"] = Out.to(self.comp.values[kv_a_buf].region(0, 0, self.step.tokens,
                                                                      self.cfg.kv_lora_rank))
            self.add(layer, la, la.label, inputs, outputs, outs)
            produced.update({f"{la.label}:{name}": f"{op}:{name}" for name in outputs})
        return produced

    def _kv_a(self, layer: int, op: str, produced: dict[str, str], buf: str | None) -> str:
        """MLA's [c_kv | k_pe] rows: the normed latent beside the rope columns of the projection
        (decode: both on chip, joined; prefill: assembled in the HBM buffer ``buf``)."""
        cfg, t = self.cfg, self.step.tokens
        r, rope = cfg.kv_lora_rank, cfg.qk_rope_dim
        q_cols = cfg.q_lora_rank or cfg.q_heads * (cfg.qk_nope_dim + rope)
        k_pe, name = f"{op}:k_pe", f"{op}:kv_a"
        self.comp.view(k_pe, produced["qkv_a_proj:y"], 0, q_cols + r, t, rope)
        if buf is None:
            self.comp.derive(name, (produced["kv_a_norm:y"], k_pe),
                             lambda c, k: TensorRef.hconcat(name, (c, k)))
            return name
        dst = self.comp.values[buf].region(0, r, t, rope)
        copy = self._op(layer, "k_pe_copy")
        self.comp.add(copy, lambda ctx, src: emit_copy(ctx, src, Out.to(dst)), {"src": k_pe},
                      {"y": f"{copy}:y"}, kind="copy")
        self.fb.layer_ops.setdefault(layer, []).append(copy)
        self.comp.derive(name, (buf, produced["kv_a_norm:y"], f"{copy}:y"),
                         lambda b, c, k: b.with_ready_of(c, 0, 0).with_ready_of(k, 0, r))
        return name

    def layer(self, i: int, x: str, residual: str) -> tuple[str, str]:
        """Add decoder layer i reading ``x`` and ``residual``; returns its (output, residual)."""
        plan = layer_launches(self.cfg, i, self.step)
        produced = self.launches(i, plan, {"x": x, "residual": residual})
        ffn = "moe" if "moe:y" in produced else "ffn"
        return produced[f"{ffn}:y"], produced["ffn_norm:h"]


def build_fused(cfg: ModelConfig, step: Step, spec: ChipSpec, *, layers: Iterable[int] | None = None,
                head: bool | None = None, tail: bool | None = None, lookahead: int = 2,
                name: str | None = None) -> FusedBuild:
    """Compose ``layers`` of ``cfg`` (default: all), with the embedding before them (``head``) and
    the final norm and logits after (``tail``), into one Program for ``step`` on ``spec``.

    ``head`` defaults to "the layers start at 0", ``tail`` to "they end at the last layer". A
    program without the head reads its input ``x`` and ``residual`` [tokens, hidden] from HBM;
    without the tail it stores its output ``x`` and ``residual`` to HBM (what a ``layer`` fusion
    launch does).

    Raises:
        InvalidArgumentError: a kernel of the plan has no emitter, or a shape a kernel refuses.
        DoesNotFit: an operator does not fit beside the values live on chip.
    """
    idx = tuple(range(cfg.layers)) if layers is None else tuple(layers)
    if not idx and head is None and tail is None:
        head = tail = True
    if not idx and not head and not tail:
        raise InvalidArgumentError("a fused program needs at least one layer, the head or the tail")
    for a, b in itertools.pairwise(idx):
        if b != a + 1:
            raise InvalidArgumentError(f"fused layers must be consecutive, got {list(idx)}")
    if idx and not 0 <= idx[0] <= idx[-1] < cfg.layers:
        raise InvalidArgumentError(f"layers {list(idx)} are outside 0..{cfg.layers - 1}")
    head = (not idx or idx[0] == 0) if head is None else head
    tail = (not idx or idx[-1] == cfg.layers - 1) if tail is None else tail
    if head and idx and idx[0] != 0:
        raise InvalidArgumentError("the head (embedding) can only precede layer 0")
    if tail and idx and idx[-1] != cfg.layers - 1:
        raise InvalidArgumentError("the tail (final norm, logits) can only follow the last layer")
    label = name or f"{cfg.name}_{step.phase}_fused"
    kb = KernelBuilder(label, chip=spec)
    comp = Composer(kb, spec, lookahead=lookahead)
    fb = FusedBuild(program=None, composer=comp, step=step, layers=idx, head=head, tail=tail)  # type: ignore[arg-type]
    g = _Graph(cfg, step, spec, comp, fb)
    t, h = step.tokens, cfg.hidden
    if head:
        x = g.head()
        residual = g.external("residual0", (t, h))  # layer 0 adds a zero residual
    else:
        x, residual = g.external("x_in", (t, h)), g.external("residual_in", (t, h))
    for i in idx:
        x, residual = g.layer(i, x, residual)
    if tail:
        g.tail(x, residual)
    else:
        for src, out in ((x, "x_out"), (residual, "residual_out")):
            dst = g.external(out, (t, h))
            del fb.externals[out]
            op = f"store.{out}"
            comp.add(op, lambda ctx, src, dst: emit_store(ctx, src, Out.to(dst)), {"src": src, "dst": dst},
                     {"y": f"{op}:y"}, kind="store")
            fb.layer_ops.setdefault(idx[-1] if idx else -1, []).append(op)
            fb.results["x" if out == "x_out" else "residual"] = out
    comp.build()
    fb.program = kb.build()
    return fb


def build_part(cfg: ModelConfig, step: Step, spec: ChipSpec, layer: int, launches: Sequence[Launch], *,
               lookahead: int = 2, name: str | None = None) -> FusedBuild:
    """One fused program of ``launches``: some of layer ``layer``'s launches for ``step`` (the
    rack model's parts of a layer: its token part, its attention, its experts), in plan order.

    Edges between them are wired as in a whole layer (``_wiring``); an input whose producer is
    not among them is an HBM tensor of its own; outputs no launch of the part reads are stored to
    HBM (the next part, after a collective, reads them from there).
    """
    kb = KernelBuilder(name or f"{cfg.name}_L{layer}_part", chip=spec)
    comp = Composer(kb, spec, lookahead=lookahead)
    fb = FusedBuild(program=None, composer=comp, step=step, layers=(layer,), head=False, tail=False)  # type: ignore[arg-type]
    g = _Graph(cfg, step, spec, comp, fb)
    produced = g.launches(layer, launches, {})
    read = set()
    for op in comp.ops:
        for n in op.inputs.values():
            read |= comp._sources(n)
    for key, value in produced.items():
        if value not in read:
            label = f"store.{key.replace(':', '.')}"
            comp.add(label, _store_to_hbm, {"src": value}, {"y": f"{label}:y"}, kind="store")
            fb.layer_ops.setdefault(layer, []).append(label)
    comp.build()
    fb.program = kb.build()
    return fb


def _store_to_hbm(ctx: Any, src: TensorRef) -> Any:
    """An operator storing an on-chip value into an HBM tensor of its own (nothing for HBM values)."""
    if src.in_hbm:
        return emit_store(ctx, src, Out())
    dst = TensorRef.hbm("out", ctx.kb.hbm("out", src.shape, src.dtype))
    return emit_store(ctx, src, Out.to(dst))


def layer_windows(kinds: Sequence[Hashable]) -> tuple[int, int]:
    """(warm-up layers, period) of the layer pattern ``kinds`` (one per layer, e.g. each layer's
    launch plan): the layers after the warm-up repeat with that period (gpt-oss: sliding/full
    alternate, period 2; DeepSeek: 3 dense layers, then MoE layers, period 1), the shortest warm-up
    plus period that repeats at least twice; (all, 1) when none does."""
    n = len(kinds)
    best = None
    for warm in range(n):
        for period in (1, 2, 3, 4):
            rest = kinds[warm:]
            repeats = len(rest) >= 2 * period and all(rest[j] == rest[j % period] for j in range(len(rest)))
            if repeats and (best is None or warm + period < sum(best)):
                best = (warm, period)
    return best or (n, 1)
