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


def _append_then_decode(common: dict, q_heads: int, *, onchip: bool, append_cores: int | None = None):
    """kv-append then attention-decode in one program on tiny: the decode reads the append's
    caches (new rows kept on chip with ``onchip``; the append on ``append_cores`` cores)."""
    from dataclasses import replace

    from jalapeno_emu.kernels.cache import emit_kv_append

    b, hkv, d = common["batch"], common["kv_heads"], common["head_dim"]
    ashape = get_kernel("kv-append").shape(common)
    dshape = get_kernel("attention-decode").shape({**common, "q_heads": q_heads})
    kb = KernelBuilder("append_decode", chip=TINY)
    comp = Composer(kb, TINY)
    for name, cols in (("q", q_heads * d), ("k", hkv * d), ("v", hkv * d), ("res", q_heads * d)):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, (b, cols), "bf16")))
    outs = {"k_cache": Out.onchip(), "v_cache": Out.onchip()} if onchip else {}
    if append_cores is None:
        comp.add_kernel("app", "kv-append", ashape, inputs={"k_new": "k", "v_new": "v"},
                        outputs={"k_cache": "kc", "v_cache": "vc"}, outs=outs)
    else:  # the append planned on fewer cores: its rows are not where the attention runs
        for ts in get_kernel("kv-append").tensors_of(ashape, TINY):
            if ts.role != "input":
                tile = kb.hbm(f"app/{ts.name}", ts.shape, ts.dtype)
                comp.value(f"app/{ts.name}", TensorRef.hbm(ts.name, tile))

        def emit(ctx, **t):
            narrow = replace(ctx, budget=replace(ctx.budget, cores=append_cores))
            return emit_kv_append(narrow, ashape, t, outs)

        own = {n: f"app/{n}" for n in ("k_cache", "v_cache", "rope_cos", "rope_sin")}
        comp.add("app", emit, {"k_new": "k", "v_new": "v", **own}, {"k_cache": "kc", "v_cache": "vc"},
                 kind="kv-append")
    comp.add_kernel("attn", "attention-decode", dshape, inputs={"q": "q", "k_cache": "kc", "v_cache": "vc"},
                    outputs={"out": "o"}, outs={"out": Out.to(comp.values["res"])})
    comp.build()
    return kb.build(), comp, ashape, dshape


def _hbm_bytes(tile) -> set[int]:
    from jalapeno_emu.isa.table import DTYPES

    row = DTYPES[tile.dtype].row_bytes(tile.cols)
    return {tile.offset + r * tile.stride + i for r in range(tile.rows) for i in range(row)}


@pytest.mark.parametrize("common, append_cores", [
    ({"batch": 1, "context": 40, "kv_heads": 2, "head_dim": 64}, None),  # a unit per core
    ({"batch": 1, "context": 64, "kv_heads": 1, "head_dim": 64}, None),  # KV splits; the new token last
    ({"batch": 3, "context": 100, "kv_heads": 2, "head_dim": 64}, None),  # three units per core
    ({"batch": 1, "context": 40, "kv_heads": 2, "head_dim": 64}, 1),  # rows on another core: DMA copies
])
def test_decode_takes_the_appended_token_from_chip(common, append_cores):
    """kv-append then attention-decode fused (a decode layer's order): the attention takes the new
    token's K and V from the append's scratchpad, never loading them from HBM (the append's stores
    there are off its path); output and caches equal the two launches bit for bit; the program is
    race-free; and it ends about a store and a dependent load earlier (less a DMA copy when the
    rows are on another core) than when the attention reads the token back from HBM."""
    from jalapeno_emu.emu.timing import run_timing

    hq, b, d, ctx = 8, common["batch"], common["head_dim"], common["context"]
    prog, comp, ashape, dshape = _append_then_decode(common, hq, onchip=True, append_cores=append_cores)
    check_program(prog, TINY)
    # No load of the attention reads a byte of the new token's rows.
    cap = -(-ctx // 32) * 32
    kc, vc = comp.values["kc"].base, comp.values["vc"].base
    items = b * common["kv_heads"]
    rows = [(kc.sub(i * d, ctx - 1, d, 1), vc.sub(i * cap + ctx - 1, 0, 1, d)) for i in range(items)]
    new = set().union(*(_hbm_bytes(k) | _hbm_bytes(v) for k, v in rows))
    regions = dict(dict(prog.meta)["regions"])
    loads = [ins for a, z in regions["attn"] for ins in prog.instructions[a:z] if ins.mnemonic == "dma.load"]
    assert loads and not any(_hbm_bytes(dict(ins.args)["src"]) & new for ins in loads)
    # The same program reading the token back from HBM does load those bytes.
    prog_hbm, *_ = _append_then_decode(common, hq, onchip=False, append_cores=append_cores)
    regions_hbm = dict(dict(prog_hbm.meta)["regions"])
    assert any(_hbm_bytes(dict(ins.args)["src"]) & new for a, z in regions_hbm["attn"]
               for ins in prog_hbm.instructions[a:z] if ins.mnemonic == "dma.load")
    # Bit for bit the launches: kv-append, then attention-decode on the caches it wrote.
    app, dec = get_kernel("kv-append").build(ashape, TINY), get_kernel("attention-decode").build(dshape, TINY)
    ains, dins = app.make_inputs(1), dec.make_inputs(2)
    ains.update(k_cache=dins["k_cache"], v_cache=dins["v_cache"])
    res = run_functional(app.program, ains)
    caches = {n: res.read(n, dt, sh) for n, (dt, sh) in app.outputs.items()}
    want = run_functional(dec.program, {**dins, **caches}).read("out", "bf16", (b, hq * d))
    data = {"q": dins["q"].reshape(b, hq * d), "k": ains["k_new"], "v": ains["v_new"],
            **{f"app/{n}": ains[n] for n in ("rope_cos", "rope_sin", "k_cache", "v_cache")},
            **{f"attn/{n}": dins[n] for n in ("rope_cos", "rope_sin", "sinks")}, **comp.ctx.consts}
    got = run_functional(prog, data)
    assert np.array_equal(_bits(got.read("res", "bf16", (b, hq * d))), _bits(want))
    for n, (dt, sh) in app.outputs.items():
        assert np.array_equal(_bits(got.read(f"app/{n}", dt, sh)), _bits(caches[n]))
    # The HBM path pays a store and a dependent load after the rotation, each a DMA set-up and an
    # HBM latency; the rows on chip cost a vector copy on the attention's core, or one DMA copy.
    trip = TINY.dma.setup_latency_s + TINY.hbm.latency_s
    expected = 2 * trip - (TINY.dma.setup_latency_s if append_cores else 0.0)
    saved = run_timing(prog_hbm, TINY).time_s - run_timing(prog, TINY).time_s
    assert 0.8 * expected <= saved <= 1.05 * expected
