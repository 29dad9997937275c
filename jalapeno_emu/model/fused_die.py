"""A step of a (tiny) model run functionally as one fused program: the data every operator needs.

Stage: model, beside ``bindings.py`` (which feeds the same kernels launch by launch). A fused
step's HBM holds, per operator, the tensors its launch would have had (``op/name``: weights in
the kernel's layout, the layer's KV cache, RoPE tables, the token ids), minus the activations,
which pass on chip; this module lays those out from the model's natural weights and cache, runs
the program, and reads back the logits and the cache rows the appends wrote. Layouts are the
ones ``bindings.py`` uses (shared helpers), so a fused step does the arithmetic of the launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import InvalidArgumentError

from .bindings import _BF16, _k_cache_layout, _v_cache_layout
from .fused import FusedBuild, build_fused
from .plan import Step

if TYPE_CHECKING:
    from .die import DieModel

__all__ = ["FusedStep"]


class FusedStep:
    """Builds (once per step shape) and runs fused programs of a step on a :class:`DieModel`:
    ``step`` fusion one program for the step, ``layer`` fusion one per layer (and one for the
    embedding, one for the final norm and logits), the activations between them in HBM."""

    def __init__(self, die: DieModel, fusion: str = "step") -> None:
        if fusion not in ("layer", "step"):
            raise InvalidArgumentError(f"fusion {fusion!r}: FusedStep runs layer or step fusion")
        self.die, self.fusion = die, fusion
        self._builds: dict[tuple, FusedBuild] = {}

    def programs(self, step: Step) -> list[FusedBuild]:
        """The fused programs of ``step``, in the order they run (cached by the step's shape)."""
        cfg = self.die.cfg
        if self.fusion == "step":
            parts = [(None, None, None)]
        else:
            parts = [((), True, False), *(((i,), False, False) for i in range(cfg.layers)), ((), False, True)]
        out = []
        for layers, head, tail in parts:
            key = (step, layers, head, tail)
            fb = self._builds.get(key)
            if fb is None:
                # A step's programs serve that step alone (its run and its timing): the next
                # step's context differs, so the builds of any other step are dropped.
                for old in [k for k in self._builds if k[0] != step]:
                    del self._builds[old]
                fb = build_fused(cfg, step, self.die.spec, layers=layers, head=head, tail=tail,
                                 name=f"{cfg.name}_{step.phase}_fused")
                replanned = [o.label for o in fb.composer.ops if o.replanned]
                if replanned:  # its layout (packed weights, tiling) is not the stand-alone launch's
                    raise InvalidArgumentError(
                        f"fused step of {cfg.name}: operators {replanned} did not fit beside the values "
                        "live on chip and were re-planned; run it unfused")
                self._builds[key] = fb
            out.append(fb)
        return out

    def run(self, step: Step, ids: np.ndarray) -> np.ndarray:
        """Run ``step`` on token ids [batch, S]; returns the logits (bf16 values) [batch, vocab]
        and updates the die's KV cache with the step's tokens."""
        cfg = self.die.cfg
        carry: dict[str, Any] = {}  # layer fusion: x and residual from one program to the next
        logits = None
        for fb in self.programs(step):
            data: dict[str, Any] = dict(fb.consts)
            if "residual0" in fb.externals:  # layer 0 of a program with the head adds a zero residual
                data["residual0"] = np.zeros((step.tokens, cfg.hidden), _BF16)
            if "x_in" in fb.externals:
                data["x_in"], data["residual_in"] = carry["x"], carry["residual"]
            ops = {o.label: o for o in fb.composer.ops}
            shapes = dict(dict(fb.program.meta)["tensors"])
            for op, (layer, launch) in fb.ops.items():
                hbm = ops[op].hbm
                for name, value in self._op_data(step, layer, launch, ids, hbm, shapes).items():
                    if name in hbm and value is not None:
                        data[hbm[name]] = value
            result = run_functional(fb.program, data)
            self._read_caches(fb, step, result)
            for key, name in fb.results.items():
                if key in ("x", "residual"):
                    carry[key] = np.asarray(result.read(name, "bf16", (step.tokens, cfg.hidden), space="hbm"))
            if "logits" in fb.results:
                logits = result.read(fb.results["logits"], "bf16", (step.batch, cfg.vocab), space="hbm")
        return np.asarray(logits, np.float32)

    # --- per-operator data -----------------------------------------------------------------
    def _op_data(self, step: Step, layer: int, launch: Any, ids: np.ndarray, hbm: dict[str, str],
                 shapes: dict[str, Any]) -> dict[str, Any]:
        die, cfg = self.die, self.die.cfg
        label = launch.label
        if layer < 0:
            return {"table": die.w.embed, "ids": ids.reshape(-1, 1).astype(np.int32)}
        if layer >= cfg.layers:
            return {"w": die.w.final_norm[None, :]} if label == "final_norm" else {"w": die.w.unembed}
        lw, pk = die.w.layers[layer], die.packed[layer]
        if label in ("attn_norm", "ffn_norm", "q_a_norm", "kv_a_norm"):
            return {"w": pk[label]}
        if label == "qkv_proj":
            return {"w": lw.wqkv, "bias": pk.get("bqkv")}
        if label == "o_proj":
            return {"w": lw.wo, "bias": pk.get("bo")}
        if label == "qkv_a_proj":
            return {"w": lw.wqkv_a}
        if label == "q_b_proj":
            return {"w": lw.wq_b}
        if label in ("moe", "ffn"):
            from .moe_binding import moe_inputs

            got = moe_inputs(die, layer, launch, None)
            got.pop("x", None)
            return got
        if label == "kv_append":
            return self._kv_append(step, layer, shapes[hbm["k_cache"]][1][1])
        if label == "mla_append":
            return self._mla_append(step, layer, launch)
        if label == "attention":
            if cfg.attention == "mla":
                return {"w_kv_b": lw.w_kv_b}
            ctx = step.positions
            out = {"rope_cos": die.cos[:ctx], "rope_sin": die.sin[:ctx]}
            if cfg.sinks:
                out["sinks"] = pk["sinks"]
            if step.phase != "decode":  # attention-prefill: K^T tables and the cache of the prior tokens
                prior = step.prior
                width = shapes[hbm["k_cache"]][1][1]
                cap = shapes[hbm["v_cache"]][1][0] // (step.batch * cfg.kv_heads)
                out |= {"rope_cos_t": np.ascontiguousarray(die.cos[:ctx].T),
                        "rope_sin_t": np.ascontiguousarray(die.sin[:ctx].T),
                        "k_cache": _k_cache_layout(die.k_cache[layer][:, :, :prior], cap, width),
                        "v_cache": _v_cache_layout(die.v_cache[layer][:, :, :prior], cap)}
            return out
        raise InvalidArgumentError(f"fused step: no data binding for operator {label!r}")

    def _kv_append(self, step: Step, i: int, width: int) -> dict[str, Any]:
        """The append's inputs: this position's RoPE row and the cache of the earlier tokens, in
        attention-decode's layout (K^T rows ``width`` wide)."""
        die = self.die
        ctx = step.context
        cap = -(-ctx // 32) * 32
        pos = slice(ctx - 1, ctx)
        return {"rope_cos": die.cos[pos], "rope_sin": die.sin[pos],
                "k_cache": _k_cache_layout(die.k_cache[i][:, :, :ctx - 1], cap, width),
                "v_cache": _v_cache_layout(die.v_cache[i][:, :, :ctx - 1], cap)}

    def _mla_append(self, step: Step, i: int, launch: Any) -> dict[str, Any]:
        die, cfg = self.die, self.die.cfg
        b, new, ctx = step.batch, step.tokens // step.batch, step.positions
        r, rope = cfg.kv_lora_rank, cfg.qk_rope_dim
        from jalapeno_emu.kernels.mla import latent_cache_capacity

        cap = latent_cache_capacity(ctx, launch.shape_dict.get("capacity", 0))
        lat = np.zeros((b, cap, r + rope), _BF16)
        lat[:, :ctx - new] = die.latent[i][:, :ctx - new]
        pos = slice(ctx - new, ctx)
        return {"rope_cos": die.cos[pos], "rope_sin": die.sin[pos],
                "kv_cache": lat.reshape(b * cap, r + rope)}

    def _read_caches(self, fb: FusedBuild, step: Step, result: Any) -> None:
        """Copy the tokens the appends wrote back into the die's natural cache."""
        die, cfg = self.die, self.die.cfg
        ops = {o.label: o for o in fb.composer.ops}
        b, ctx = step.batch, step.positions
        new = step.tokens // step.batch
        for i in fb.layers:
            if cfg.attention == "gqa":
                # decode: the append wrote position ctx-1; prefill: the attention wrote the chunk
                app = ops.get(f"L{i}.kv_append") or ops.get(f"L{i}.attention")
                if app is None or "k_cache" not in app.hbm:
                    continue
                hkv, d = cfg.kv_heads, cfg.head_dim
                k_name, v_name = app.hbm["k_cache"], app.hbm["v_cache"]
                shapes = dict(dict(fb.program.meta)["tensors"])
                kc = result.read(k_name, "bf16", shapes[k_name][1], space="hbm")
                vc = result.read(v_name, "bf16", shapes[v_name][1], space="hbm")
                cap = vc.shape[0] // (b * hkv)
                kt = np.asarray(kc).reshape(b, hkv, d, -1)
                new_pos = slice(ctx - new, ctx)
                die.k_cache[i][:, :, new_pos] = kt[..., new_pos].transpose(0, 1, 3, 2)
                die.v_cache[i][:, :, new_pos] = np.asarray(vc).reshape(b, hkv, cap, d)[:, :, new_pos]
            else:
                app = ops[f"L{i}.mla_append"]
                name = app.hbm["kv_cache"]
                shape = dict(dict(fb.program.meta)["tensors"])[name][1]
                cache = np.asarray(result.read(name, "bf16", shape, space="hbm"))
                cap = shape[0] // b
                die.latent[i][:, ctx - new:ctx] = cache.reshape(b, cap, -1)[:, ctx - new:ctx]
