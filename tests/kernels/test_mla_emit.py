"""mla-decode / mla-prefill as emitters in fused programs (kernels/compose.py): q produced on chip
by a gemm, the latent cache partly written by another operator of the same program, outputs in
HBM or kept on chip; each equal bit for bit to the stand-alone launch on the same data, and
accepted by the checker (no races: every read of a written row is ordered after the write)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels.compose import Composer
from jalapeno_emu.kernels.emit import Out, TensorRef, emit_copy, emit_store
from jalapeno_emu.kernels.gemm import gemm_reference
from jalapeno_emu.kernels.registry import get_kernel

BF16 = ml_dtypes.bfloat16
TINY = load_preset("tiny")
DIMS = {"q_heads": 4, "kv_lora_rank": 64, "rope_dim": 32, "nope_dim": 32, "v_head_dim": 32}
H, R, P, N, V = 4, 64, 32, 32, 32
D, W, K = N + P, R + P, 64  # q head, cache row, the q projection's input width


def _gemm_shape(m: int, n: int) -> dict:
    return get_kernel("gemm").shape({"m": m, "n": n, "k": K, "weight_fmt": "bf16", "act_fmt": "bf16",
                                     "bias": False})


def _standalone(kernel: str, shape: dict, data: dict, out_shape: tuple[int, int]) -> np.ndarray:
    """The stand-alone launch on ``data`` (q head-major, as its program allocates it)."""
    build = get_kernel(kernel).build(shape, TINY)
    consts = {k: v for k, v in build.make_inputs(0).items() if k == "causal_mask"}
    got = run_functional(build.program, {**consts, **data}).read("out", "bf16", out_shape)
    return np.asarray(got)


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("batch, context, splits, out_onchip", [
    (1, 80, 2, False),  # split-KV: split 1 holds the written row 79 in its second tile
    (2, 64, 1, True),  # a core per sequence, q_pe with q_lat from the head cores, out kept on chip
])
def test_decode_with_q_on_chip_and_an_appended_row_equals_the_launch(batch, context, splits, out_onchip):
    shape = get_kernel("mla-decode").shape({"batch": batch, "context": context, "kv_splits": splits,
                                            "kv_tile": 32, **DIMS})
    cap = -(-context // 32) * 32
    kb = KernelBuilder("fused_mla_decode", chip=TINY)
    comp = Composer(kb, TINY)
    for name, shp in (("x", (batch, K)), ("x_row", (1, K)), ("cache", (batch * cap, W)),
                      ("res", (batch, H * V))):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, shp, "bf16")))
    comp.add_kernel("q_proj", "gemm", _gemm_shape(batch, H * D), inputs={"x": "x"}, outputs={"y": "q"},
                    outs={"y": Out.onchip()})
    # Another operator writes sequence 0's row context-1 (what mla-append does): the attention
    # waits for it only where it reads that row.
    comp.add_kernel("row", "gemm", _gemm_shape(1, W), inputs={"x": "x_row"}, outputs={"y": "new_row"},
                    outs={"y": Out.onchip()})
    last = context - 1
    dst = comp.values["cache"].region(last, 0, 1, W)
    comp.add("append", lambda ctx, src: emit_copy(ctx, src, Out.to(dst)), {"src": "new_row"},
             {"y": "appended"}, kind="copy")
    comp.derive("kv", ("cache", "appended"), lambda c, a: c.with_ready_of(a, last, 0))
    comp.add_kernel("attn", "mla-decode", shape, inputs={"q": "q", "kv_cache": "kv"}, outputs={"out": "o"},
                    outs={"out": Out.onchip()} if out_onchip else None)
    if out_onchip:  # the kept pieces, stored by the next operator
        comp.add("store", lambda ctx, src: emit_store(ctx, src, Out.to(comp.values["res"])), {"src": "o"},
                 {"y": "stored"}, kind="store")
    comp.build()
    prog = kb.build()
    check_program(prog, TINY)

    rng = np.random.default_rng(1)
    data = {"x": rng.standard_normal((batch, K)).astype(BF16),
            "x_row": rng.standard_normal((1, K)).astype(BF16),
            "cache": rng.standard_normal((batch * cap, W)).astype(BF16),
            "q_proj/w": (0.2 * rng.standard_normal((K, H * D))).astype(BF16),
            "row/w": (0.2 * rng.standard_normal((K, W))).astype(BF16),
            "attn/w_kv_b": (rng.standard_normal((H * (N + V), R)) / 8).astype(BF16)}
    result = run_functional(prog, {**data, **comp.ctx.consts})
    got = result.read("res" if out_onchip else "attn/out", "bf16", (batch, H * V))

    q = gemm_reference(data["x"], data["q_proj/w"], None)
    cache = np.array(data["cache"])
    cache[last] = gemm_reference(data["x_row"], data["row/w"], None)[0]
    want = _standalone("mla-decode", shape, {"q": q.reshape(batch * H, D), "kv_cache": cache,
                                             "w_kv_b": data["attn/w_kv_b"]}, (batch * H, V))
    assert np.array_equal(_bits(got), _bits(want.reshape(batch, H * V)))

    # The cache tiles that do not hold the written row load before the append has stored it
    # (prefetched while the projections run); the one that does, after.
    ins = prog.instructions
    cache_a = prog.allocation("cache")
    store_at = next(i for i, x in enumerate(ins) if x.mnemonic == "dma.store" and
                    cache_a.offset <= x.arg("dst").offset < cache_a.end)
    loads = [(i, (x.arg("src").offset - cache_a.offset) // (W * 2), x.arg("src").rows)
             for i, x in enumerate(ins)
             if x.mnemonic == "dma.load" and cache_a.offset <= x.arg("src").offset < cache_a.end]
    assert any(i < store_at for i, r0, n in loads if not r0 <= last < r0 + n)
    assert all(i > store_at for i, r0, n in loads if r0 <= last < r0 + n)


def test_prefill_with_q_on_chip_equals_the_launch():
    B, S, prior = 1, 64, 32
    shape = get_kernel("mla-prefill").shape({"batch": B, "seq": S, "prior": prior, "kv_tile": 32,
                                             **dict(DIMS, q_heads=2)})
    h = 2
    kb = KernelBuilder("fused_mla_prefill", chip=TINY)
    comp = Composer(kb, TINY)
    comp.value("x", TensorRef.hbm("x", kb.hbm("x", (B * S, K), "bf16")))
    comp.add_kernel("q_proj", "gemm", _gemm_shape(B * S, h * D), inputs={"x": "x"}, outputs={"y": "q"},
                    outs={"y": Out.onchip()})
    comp.add_kernel("attn", "mla-prefill", shape, inputs={"q": "q"}, outputs={"out": "o"})
    comp.build()
    prog = kb.build()
    check_program(prog, TINY)
    rng = np.random.default_rng(2)
    data = {"x": rng.standard_normal((B * S, K)).astype(BF16),
            "q_proj/w": (0.2 * rng.standard_normal((K, h * D))).astype(BF16),
            "attn/kv_cache": rng.standard_normal((B * (prior + S), W)).astype(BF16),
            "attn/w_kv_b": (rng.standard_normal((h * (N + V), R)) / 8).astype(BF16)}
    got = run_functional(prog, {**data, **comp.ctx.consts}).read("attn/out", "bf16", (B * S, h * V))
    q = gemm_reference(data["x"], data["q_proj/w"], None)
    want = _standalone("mla-prefill", shape, {"q": q.reshape(B * S * h, D), "kv_cache": data["attn/kv_cache"],
                                              "w_kv_b": data["attn/w_kv_b"]}, (B * S * h, V))
    assert np.array_equal(_bits(got), _bits(want.reshape(B * S, h * V)))


def test_tensors_are_token_major_and_scratch_only_on_the_small_tiling():
    kd = get_kernel("mla-decode")
    specs = {t.name: t for t in kd.tensors_of(kd.shape({"batch": 3, "context": 40, **DIMS}), TINY)}
    assert specs["q"].shape == (3, H * D) and specs["q"].role == "input"
    assert specs["out"].shape == (3, H * V) and specs["out"].role == "output"
    assert specs["kv_cache"].role == specs["w_kv_b"].role == "weight" and "q_lat" not in specs
    big = dict(DIMS, q_heads=128, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_head_dim=128)
    small = {t.name: t.role for t in kd.tensors_of(kd.shape({"batch": 2, "context": 64, **big}), TINY)}
    assert small["q_lat"] == small["o_lat"] == "scratch"
    kp = get_kernel("mla-prefill")
    pre = {t.name: t for t in kp.tensors_of(kp.shape({"batch": 2, "seq": 64, "prior": 32, **DIMS}), TINY)}
    assert pre["q"].shape == (2 * 64, H * D) and pre["out"].shape == (2 * 64, H * V)
    assert pre["kv_cache"].shape == (2 * 96, W) and "causal_mask" not in pre  # a constant of the emitter


@pytest.mark.parametrize("scratchpad", [None, "32KiB"])
def test_decode_reads_heads_that_straddle_the_producers_pieces(scratchpad):
    """rope_dim 64, 5 heads: 96-wide heads in the gemm's 256- and 224-column output blocks, head
    2's q_pe split between the two cores' pieces; on tiny (one core per sequence) and on a 32 KiB
    scratchpad (the small tiling: q_pe per head group, gathered piece by piece)."""
    from jalapeno_emu.chip.load import apply_overrides

    spec = apply_overrides(TINY, [f"sram.scratchpad_bytes={scratchpad}"]) if scratchpad else TINY
    h, rope, B, C = 5, 64, 3, 40
    d, w = N + rope, R + rope
    dims = dict(DIMS, rope_dim=rope, q_heads=h)
    shape = get_kernel("mla-decode").shape({"batch": B, "context": C, **dims})
    small = get_kernel("mla-decode").build(shape, spec).notes.get("path") == "small-scratchpad"
    assert small == bool(scratchpad)
    kb = KernelBuilder("fused_mla_heads", chip=spec)
    comp = Composer(kb, spec)
    comp.value("x", TensorRef.hbm("x", kb.hbm("x", (B, K), "bf16")))
    comp.add_kernel("q_proj", "gemm", _gemm_shape(B, h * d), inputs={"x": "x"}, outputs={"y": "q"},
                    outs={"y": Out.onchip()})
    comp.add_kernel("attn", "mla-decode", shape, inputs={"q": "q"}, outputs={"out": "o"})
    comp.build()
    q_ref = comp.values["q"]
    assert any(2 * d + N < p.c0 < 3 * d for p in q_ref.pieces)  # head 2's q_pe split
    prog = kb.build()
    check_program(prog, spec)
    rng = np.random.default_rng(3)
    cap = 64
    data = {"x": rng.standard_normal((B, K)).astype(BF16),
            "q_proj/w": (0.2 * rng.standard_normal((K, h * d))).astype(BF16),
            "attn/kv_cache": rng.standard_normal((B * cap, w)).astype(BF16),
            "attn/w_kv_b": (rng.standard_normal((h * (N + V), R)) / 8).astype(BF16)}
    got = run_functional(prog, {**data, **comp.ctx.consts}).read("attn/out", "bf16", (B, h * V))
    q = gemm_reference(data["x"], data["q_proj/w"], None)
    build = get_kernel("mla-decode").build(shape, spec)
    want = run_functional(build.program, {"q": q.reshape(B * h, d), "kv_cache": data["attn/kv_cache"],
                                          "w_kv_b": data["attn/w_kv_b"]}).read("out", "bf16", (B * h, V))
    assert np.array_equal(_bits(got), _bits(np.asarray(want).reshape(B, h * V)))


def _append_then_decode(batch: int, context: int, q_rot: str,
                        q_from: str = "gemm") -> tuple[np.ndarray, object]:
    """q projection (on chip; ``q_from="hbm"``: q an HBM input) -> mla-append -> mla-decode in
    one program, with the rotated queries kept on chip (``q_rot="onchip"``) or stored to an HBM
    tensor (``"hbm"``); returns (out, program) for fixed data."""
    dims = {"batch": batch, "context": context, **DIMS}
    kb = KernelBuilder(f"append_decode_{q_rot}", chip=TINY)
    comp = Composer(kb, TINY)
    cap = -(-context // 32) * 32
    for name, shp in (("x", (batch, K)), ("kv_a", (batch, W)), ("cache", (batch * cap, W)),
                      ("q_rot_hbm", (batch, H * D))):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, shp, "bf16")))
    if q_from == "gemm":
        comp.add_kernel("q_proj", "gemm", _gemm_shape(batch, H * D), inputs={"x": "x"}, outputs={"y": "q"},
                        outs={"y": Out.onchip()})
    else:
        comp.value("q", TensorRef.hbm("q", kb.hbm("q", (batch, H * D), "bf16")))
    place = Out.onchip() if q_rot == "onchip" else Out.to(comp.values["q_rot_hbm"])
    append_dims = {k: v for k, v in dims.items() if k != "v_head_dim"}
    comp.add_kernel("append", "mla-append", get_kernel("mla-append").shape(append_dims),
                    inputs={"q": "q", "kv_a": "kv_a", "kv_cache": "cache"},
                    outputs={"q_rot": "q_rot", "kv_cache": "kv"}, outs={"q_rot": place})
    comp.add_kernel("attn", "mla-decode", get_kernel("mla-decode").shape({**dims, "kv_tile": 32}),
                    inputs={"q": "q_rot", "kv_cache": "kv"}, outputs={"out": "o"})
    comp.build()
    prog = kb.build()
    check_program(prog, TINY)
    rng = np.random.default_rng(3)
    data = {"x": rng.standard_normal((batch, K)).astype(BF16),
            "kv_a": rng.standard_normal((batch, W)).astype(BF16),
            "cache": rng.standard_normal((batch * cap, W)).astype(BF16),
            "attn/w_kv_b": (rng.standard_normal((H * (N + V), R)) / 8).astype(BF16)}
    if q_from == "gemm":
        data["q_proj/w"] = (0.2 * rng.standard_normal((K, H * D))).astype(BF16)
    else:
        data["q"] = rng.standard_normal((batch, H * D)).astype(BF16)
    result = run_functional(prog, {**data, **comp.ctx.consts})
    return np.asarray(result.read("attn/out", "bf16", (batch, H * V))), prog


@pytest.mark.parametrize("batch, q_from", [(1, "gemm"), (2, "gemm"), (2, "hbm")])
def test_decode_queries_kept_on_chip_by_the_append_equal_the_hbm_round_trip(batch, q_from):
    """A decode step's rotated queries stay on chip (no store to HBM and load back): rotated
    where the projection left them (q on chip, whole heads per core: the head-local path, no
    row jobs for q), or in the append's row jobs (q from HBM); either way the attention's output
    is the same bits as through HBM."""
    kept, prog = _append_then_decode(batch, 50, "onchip", q_from)
    via_hbm, prog_hbm = _append_then_decode(batch, 50, "hbm", q_from)
    assert np.array_equal(_bits(kept), _bits(via_hbm))
    head_local = any(a.name == "append/q_cos" for a in prog.allocations)
    assert head_local == (q_from == "gemm")
    assert not any(a.name.endswith("q_rot") for a in prog.allocations if a.space.name == "HBM")
    wq = N + P
    q_rot_stores = [i for i in prog_hbm.instructions if i.mnemonic == "dma.store" and i.arg("dst").cols == wq]
    assert q_rot_stores
    assert not [i for i in prog.instructions if i.mnemonic == "dma.store" and i.arg("dst").cols == wq]
