"""attention-prefill as an emitter (kernels/attention.py ``emit_prefill``): the stand-alone
programs unchanged, and in fused programs (kernels/compose.py) q, k and v read as column views of
a QKV projection's output (in HBM with readiness regions, or on chip), k token-major and
transposed on chip; outputs and caches equal bit for bit to the stand-alone launch on the same
data (which takes K^T), and the composed program accepted by the checker (no races: every read of
the projection's output is ordered after the store or the piece it reads)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.chip.load import apply_overrides
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import run_kernel
from jalapeno_emu.kernels.compose import Composer
from jalapeno_emu.kernels.emit import Out, TensorRef, emit_store
from jalapeno_emu.kernels.gemm import gemm_reference
from jalapeno_emu.kernels.planning import Budget
from jalapeno_emu.kernels.registry import get_kernel

BF16 = ml_dtypes.bfloat16
TINY = load_preset("tiny")
# The fused programs run on a tiny with room for the projection and the attention side by side
# (memory and accumulators), each planning with tiny's own budget: the plans are the stand-alone
# launches' on tiny, and the attention's prefetch part runs while the projection computes, so
# only the readiness regions order its reads of q, k and v after their writes.
ROOMY = apply_overrides(TINY, ["sram.scratchpad_bytes=1MiB", "sram.accumulator_bytes=512KiB"])
K = 64  # the projection's input width
GPT_OSS = dict(q_heads=64, kv_heads=8, head_dim=64)


@pytest.mark.parametrize("preset, shape, instructions, time_s", [
    ("tiny", {}, 1104, 2.0469715476190497e-05),
    ("tiny", {"prior": 96, "seq": 64, "window": 48, "capacity": 192}, 622, 1.3413220779220789e-05),
    ("jalapeno-v1", dict(batch=1, seq=512, prior=1536, **GPT_OSS), 19216, 3.405252121212121e-05),
    ("b200", dict(batch=1, seq=512, prior=1024, window=128, q_heads=8, kv_heads=1, head_dim=64), 12752,
     7.32724350852255e-06),  # the lean path (GPU shared memory)
])
def test_standalone_programs_are_unchanged(preset, shape, instructions, time_s):
    # Pinned before the kernel became an emitter (the programs were identical instruction for
    # instruction, allocations included): the stand-alone launch emits phase 1 first and
    # prefetches nothing, as it always did.
    r = run_kernel("attention-prefill", shape, preset=preset, safety_checks=False)
    assert r.summary["instructions"] == instructions
    assert r.summary["time_s"] == pytest.approx(time_s, rel=1e-12)


def test_tensors_are_token_major_and_the_caches_inout():
    kd = get_kernel("attention-prefill")
    shape = kd.shape({"batch": 2, "seq": 64, "prior": 32})
    specs = {t.name: t for t in kd.tensors_of(shape, TINY)}
    assert specs["q"].shape == specs["out"].shape == (128, 4 * 64)
    assert specs["k"].shape == specs["v"].shape == (128, 2 * 64)  # k as the projection writes it
    assert {n: specs[n].role for n in ("q", "k", "v", "out")} == {
        "q": "input", "k": "input", "v": "input", "out": "output"}
    assert specs["k_cache"].role == specs["v_cache"].role == "inout"
    weights = ("rope_cos", "rope_sin", "rope_cos_t", "rope_sin_t", "sinks")
    assert all(specs[n].role == "weight" for n in weights)
    assert "mask" not in specs  # a constant of the emitter
    build = kd.build(shape, TINY)
    recorded = dict(dict(build.program.meta)["tensors"])
    for name in ("k_cache", "v_cache", "rope_cos_t", "sinks"):
        assert tuple(recorded[name][1]) == specs[name].shape


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("over, qkv_onchip, out_onchip", [
    ({"seq": 64}, False, False),  # a whole prompt (prior 0), the projection's output in HBM
    ({"seq": 64, "prior": 32}, True, False),  # q, k, v pieces on chip; a prior tile prefetched
    ({"seq": 128, "prior": 64, "window": 40, "sinks": False}, False, True),  # window; out kept, stored
    ({"batch": 2, "seq": 64, "prior": 32, "window": 40}, False, False),  # two sequences, sinks, window
])
def test_prefill_reading_a_qkv_projection_equals_the_launch(over, qkv_onchip, out_onchip):
    kd = get_kernel("attention-prefill")
    shape = kd.shape(over)
    b, s, hq, hkv, d = (shape[k] for k in ("batch", "seq", "q_heads", "kv_heads", "head_dim"))
    t, width = b * s, (hq + 2 * hkv) * d
    kb = KernelBuilder("fused_prefill", chip=ROOMY)
    comp = Composer(kb, ROOMY, budget=Budget.of(TINY))
    comp.value("x", TensorRef.hbm("x", kb.hbm("x", (t, K), "bf16")))
    comp.value("res", TensorRef.hbm("res", kb.hbm("res", (t, hq * d), "bf16")))
    gemm = get_kernel("gemm").shape({"m": t, "n": width, "k": K, "weight_fmt": "bf16", "act_fmt": "bf16",
                                     "bias": False})
    comp.add_kernel("qkv", "gemm", gemm, inputs={"x": "x"}, outputs={"y": "qkv"},
                    outs={"y": Out.onchip()} if qkv_onchip else None)
    comp.view("q", "qkv", 0, 0, t, hq * d)
    comp.view("k", "qkv", 0, hq * d, t, hkv * d)
    comp.view("v", "qkv", 0, (hq + hkv) * d, t, hkv * d)
    comp.add_kernel("attn", "attention-prefill", shape, inputs={"q": "q", "k": "k", "v": "v"},
                    outputs={"out": "o", "k_cache": "kc", "v_cache": "vc"},
                    outs={"out": Out.onchip()} if out_onchip else None)
    if out_onchip:  # the kept pieces (one per head and query tile), stored by the next operator
        comp.add("store", lambda ctx, src: emit_store(ctx, src, Out.to(comp.values["res"])), {"src": "o"},
                 {"y": "stored"}, kind="store")
    comp.build()
    assert not any(op.replanned for op in comp.ops)
    assert comp.values["kc"].waits() and comp.values["vc"].waits()  # the chunk's cache regions
    prog = kb.build()
    check_program(prog, ROOMY)

    # The attention's prefetch part ran ahead of the projection's rest: its first load comes
    # before the projection's last instruction (so only readiness orders its reads of q, k, v).
    ins = prog.instructions
    first_attn = min(i for i, x in enumerate(ins) if x.mnemonic == "dma.load" and "attention" in x.source)
    last_gemm = max(i for i, x in enumerate(ins) if "gemm" in x.source)
    assert first_attn < last_gemm

    build = kd.build(shape, TINY)  # the stand-alone launch, on the data the fused program sees
    ins_sa = build.make_inputs(5)
    rng = np.random.default_rng(7)
    data = {"x": rng.standard_normal((t, K)).astype(BF16),
            "qkv/w": (0.3 * rng.standard_normal((K, width))).astype(BF16)}
    for name in ("k_cache", "v_cache", "rope_cos", "rope_sin", "rope_cos_t", "rope_sin_t", "sinks"):
        if name in ins_sa:
            data[f"attn/{name}"] = ins_sa[name]
    got = run_functional(prog, {**data, **comp.ctx.consts})
    qkv = np.asarray(gemm_reference(data["x"], data["qkv/w"], None))
    k = qkv[:, hq * d:(hq + hkv) * d]
    kt = k.reshape(b, s, hkv, d).transpose(0, 2, 3, 1).reshape(b * hkv * d, s)  # the launch's K^T
    ins_sa.update(q=np.ascontiguousarray(qkv[:, :hq * d]), k=np.ascontiguousarray(kt),
                  v=np.ascontiguousarray(qkv[:, (hq + hkv) * d:]))
    want = run_functional(build.program, ins_sa)
    for name, (dt, shp) in build.outputs.items():
        fused = "res" if name == "out" and out_onchip else f"attn/{name}"
        assert np.array_equal(_bits(got.read(fused, dt, shp)), _bits(want.read(name, dt, shp))), name


def test_fused_gpt_oss_prefill_layer_builds_and_checks():
    """tiny-gpt-oss layer 0 (sliding window, sinks) as one prefill program: the attention reads
    q, k and v from the QKV projection's HBM output, waiting only for the tiles it reads."""
    from jalapeno_emu.model.config import load_model_config
    from jalapeno_emu.model.fused import build_fused
    from jalapeno_emu.model.plan import Step

    cfg = load_model_config("tiny-gpt-oss")
    fb = build_fused(cfg, Step("prefill", batch=1, seq=32), TINY, layers=[0])
    assert "L0.attention" in fb.layer_ops[0]
    assert not any(op.replanned for op in fb.composer.ops)
    check_program(fb.program, TINY)


def test_decode_output_kept_on_chip_is_one_piece_per_run_of_heads_and_equals_the_launch():
    """attention-decode with its output kept on chip: a core's units of one sequence's
    consecutive KV heads leave one row piece (a consumer copies one piece per core, not one per
    head group), and the stored result is the launch's, bit for bit."""
    kd = get_kernel("attention-decode")
    shape = kd.shape({"batch": 2, "context": 40, "q_heads": 4, "kv_heads": 2, "head_dim": 64})
    b, hq, d = shape["batch"], shape["q_heads"], shape["head_dim"]
    kb = KernelBuilder("fused_decode", chip=TINY)
    comp = Composer(kb, TINY)
    comp.value("q", TensorRef.hbm("q", kb.hbm("q", (b, hq * d), "bf16")))
    comp.value("res", TensorRef.hbm("res", kb.hbm("res", (b, hq * d), "bf16")))
    comp.add_kernel("attn", "attention-decode", shape, inputs={"q": "q"}, outputs={"out": "o"},
                    outs={"out": Out.onchip()})
    comp.add("store", lambda ctx, src: emit_store(ctx, src, Out.to(comp.values["res"])), {"src": "o"},
             {"y": "stored"}, kind="store")
    comp.build()
    pieces = comp.values["o"].pieces
    # 2 sequences x 2 KV heads on 2 cores: each core holds one sequence's whole row
    assert [(p.r0, p.c0, p.rows, p.cols) for p in pieces] == [(0, 0, 1, hq * d), (1, 0, 1, hq * d)]
    prog = kb.build()
    check_program(prog, TINY)
    build = kd.build(shape, TINY)
    ins = build.make_inputs(3)
    # the launch's q is [b * hq, d], the fused program's [b, hq * d]: the same bytes
    data = {"q": ins["q"].reshape(b, hq * d), **{f"attn/{n}": v for n, v in ins.items() if n != "q"}}
    got = run_functional(prog, {**data, **comp.ctx.consts}).read("res", "bf16", (b, hq * d))
    want = run_functional(build.program, ins).read("out", "bf16", (b, hq * d))
    assert np.array_equal(_bits(got), _bits(want))
