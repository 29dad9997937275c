"""Fused programs (kernels/compose.py): operators composed into one Program compute what the
stand-alone launches compute, bit for bit, pass the checker, and reuse memory safely."""

from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import OutOfBounds, Race
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.table import Space
from jalapeno_emu.kernels.compose import Arena, ArenaFull, Composer
from jalapeno_emu.kernels.emit import Out, TensorRef, run_emitter
from jalapeno_emu.kernels.gemm import gemm_reference
from jalapeno_emu.kernels.norm import emit_rmsnorm, rmsnorm_reference
from jalapeno_emu.kernels.registry import get_kernel

BF16 = ml_dtypes.bfloat16
TINY = load_preset("tiny")


def _norm_gemm_norm(t: int, h: int, n: int, placement: str, lookahead: int = 2):
    """attn-norm -> gemm -> norm, the first norm's outputs placed per ``placement``."""
    kb = KernelBuilder("fused", chip=TINY)
    comp = Composer(kb, TINY, lookahead=lookahead)
    for name, shape in (("x", (t, h)), ("res", (t, h))):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, shape, "bf16")))
    place = {"replicated": Out.replicated(range(TINY.core.count)), "onchip": Out.onchip()}[placement]
    norm = get_kernel("rmsnorm")
    comp.add_kernel("n1", "rmsnorm", norm.shape({"tokens": t, "hidden": h}),
                    inputs={"x": "x", "residual": "res"}, outputs={"y": "y1", "h": "h1"},
                    outs={"y": place, "h": place})
    gemm = get_kernel("gemm")
    comp.add_kernel("g", "gemm", gemm.shape({"m": t, "n": n, "k": h, "weight_fmt": "bf16", "act_fmt": "bf16",
                                             "bias": True}),
                    inputs={"x": "y1"}, outputs={"y": "g"}, outs={"y": Out.onchip()})
    comp.add_kernel("n2", "rmsnorm", norm.shape({"tokens": t, "hidden": n, "residual": False}),
                    inputs={"x": "g"}, outputs={"y": "out"})
    comp.build()
    return kb.build(), comp


@pytest.mark.parametrize(("placement", "t", "h"), [("replicated", 6, 256), ("onchip", 6, 256),
                                                  # x of 16 KiB, 1/16 of tiny's scratchpad: the GEMM
                                                  # relays each panel, fetched from the norm's cores
                                                  ("onchip", 16, 512)])
def test_fused_chain_is_bit_identical_to_the_launches(placement, t, h):
    n = 512
    prog, comp = _norm_gemm_norm(t, h, n, placement)
    check_program(prog, TINY)  # no races, no deadlock, memory reuse ordered
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((t, h)).astype(BF16), "res": rng.standard_normal((t, h)).astype(BF16),
            "n1/w": (1 + 0.1 * rng.standard_normal((1, h))).astype(BF16),
            "g/w": (0.05 * rng.standard_normal((h, n))).astype(BF16),
            "g/bias": rng.standard_normal((1, n)).astype(BF16),
            "n2/w": (1 + 0.1 * rng.standard_normal((1, n))).astype(BF16)}
    ops = {op.label: op for op in comp.ops}
    assert ops["g"].hbm == {"w": "g/w", "bias": "g/bias"}  # what a functional run binds
    got = run_functional(prog, {**data, **comp.ctx.consts}).read("n2/y", "bf16", (t, n))
    y1, _ = rmsnorm_reference(data["x"], data["res"], data["n1/w"], 1e-5)
    g = gemm_reference(np.asarray(y1), data["g/w"], data["g/bias"])
    want, _ = rmsnorm_reference(g, None, data["n2/w"], 1e-5)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_fusion_beats_launches_and_respects_the_bound():
    prog, _ = _norm_gemm_norm(8, 256, 512, "replicated")
    fused = run_timing(prog, TINY)
    launches = 0.0
    for kernel, shape in (("rmsnorm", {"tokens": 8, "hidden": 256}),
                          ("gemm", {"m": 8, "n": 512, "k": 256, "weight_fmt": "bf16", "act_fmt": "bf16",
                                    "bias": True}),
                          ("rmsnorm", {"tokens": 8, "hidden": 512, "residual": False})):
        kd = get_kernel(kernel)
        launches += run_timing(kd.build(kd.shape(shape), TINY).program, TINY).time_s
    assert fused.time_s < launches  # one launch, no HBM round trips between the operators
    assert fused.time_s >= fused.lower_bound_s()
    # One launch cost for the whole program.
    assert fused.launch_s == TINY.sync.kernel_launch_s


def test_regions_reuse_memory_only_after_the_fence():
    """Operators too big to sit side by side reuse each other's scratchpad: the program still
    checks (the fences order the reuse), and allocations of different regions overlap. (The gemm
    does not fit its stand-alone plan beside the norm's outputs kept on chip: it is re-planned.)"""
    prog, comp = _norm_gemm_norm(32, 1024, 1024, "onchip", lookahead=0)
    assert [op.replanned for op in comp.ops] == [False, True, False]
    check_program(prog, TINY)
    sram = [a for a in prog.allocations if a.space.value == "sram" and a.core == 0]
    overlaps = [(a.name, b.name) for a in sram for b in sram
                if a.scope != b.scope and a.offset < b.end and b.offset < a.end]
    assert overlaps, "regions did not reuse each other's memory"
    waits = [i for i in prog.instructions if i.mnemonic == "sem.wait" and i.source.endswith(":fence")]
    assert waits, "reused memory without a fence"


def test_unfenced_reuse_is_a_race_and_same_scope_overlap_is_refused():
    kb = KernelBuilder("bad", chip=TINY)
    x = kb.hbm("x", (8, 64), "f32")
    c0 = kb.core(0)
    with kb.region("a"):
        a = kb.sram(0, "buf", (8, 64), "f32")
        c0.dma[0].load(a, x)
    arena = Arena(TINY)  # a fresh arena hands out offset 0 again, with no fence
    with kb.region("b", arena=arena):
        b = kb.sram(0, "buf", (8, 64), "f32")
        c0.vpu.exp(b, b)
    assert a.offset == b.offset
    with pytest.raises(Race):
        check_program(kb.build(), TINY)
    kb2 = KernelBuilder("bad2", chip=TINY)
    with kb2.region("a", arena=Arena(TINY)) as r:
        kb2.sram(0, "p", (8, 64), "f32")
        r.arena._free.clear()  # force the next allocation onto the same bytes
        kb2.sram(0, "q", (8, 64), "f32")
    with pytest.raises(OutOfBounds, match="overlap"):
        check_program(kb2.build(), TINY)


def test_standalone_emitter_and_build_agree():
    """A stand-alone launch is its emitter with HBM tensors: same program as build()."""
    kd = get_kernel("rmsnorm")
    shape = kd.shape({"tokens": 4, "hidden": 128})
    built = kd.build(shape, TINY).program
    kb = KernelBuilder(built.name, chip=TINY)
    from jalapeno_emu.kernels.emit import EmitCtx

    ctx = EmitCtx.standalone(kb)
    refs = {n: TensorRef.hbm(n, kb.hbm(n, (4, 128), "bf16")) for n in ("x", "residual")}
    refs["w"] = TensorRef.hbm("w", kb.hbm("w", (1, 128), "bf16"))
    eps = TensorRef.hbm("eps", ctx.const("eps", np.full((1, 1), 1e-5, np.float32), "f32"))
    y, h = (TensorRef.hbm(n, kb.hbm(n, (4, 128), "bf16")) for n in ("y", "h"))
    run_emitter(emit_rmsnorm(ctx, refs["x"], refs["w"], eps=1e-5, residual=refs["residual"], eps_ref=eps,
                             y_out=Out.to(y), h_out=Out.to(h)))
    again = kb.build()
    assert [(i.mnemonic, str(i.engine), i.args) for i in again.instructions] == \
        [(i.mnemonic, str(i.engine), i.args) for i in built.instructions]


def test_a_fused_gemv_streams_its_rest_off_the_queue_of_the_next_prefetches():
    """A decode GEMV kept on chip that streams twice what its slots hold: the chunks of its prefetch
    part on queue 1, the chunks streamed after it on the last queue, never on queue 0 (where the
    FFN streams its weights and the appends load: a DMA signal lands only after everything issued
    before it on its queue, and the next operators' prefetch is issued before this one's rest).
    Same arithmetic as the launches, and the checker accepts the program."""
    from jalapeno_emu.isa.table import Space
    from jalapeno_emu.kernels.gemm import FUSED_PREFETCH_QUEUE

    t, h, n = 1, 1024, 256  # tiny: 2 slots of 480-deep chunks, 4 chunks per core
    kb = KernelBuilder("fused", chip=TINY)
    comp = Composer(kb, TINY)
    for name, shape in (("x", (t, h)), ("res", (t, h))):
        comp.value(name, TensorRef.hbm(name, kb.hbm(name, shape, "bf16")))
    norm, gemm = get_kernel("rmsnorm"), get_kernel("gemm")
    comp.add_kernel("n1", "rmsnorm", norm.shape({"tokens": t, "hidden": h}),
                    inputs={"x": "x", "residual": "res"}, outputs={"y": "y1", "h": "h1"},
                    outs={"y": Out.onchip(), "h": Out.onchip()})
    comp.add_kernel("g", "gemm", gemm.shape({"m": t, "n": n, "k": h, "weight_fmt": "bf16", "act_fmt": "bf16",
                                             "bias": False}),
                    inputs={"x": "y1"}, outputs={"y": "g"}, outs={"y": Out.onchip()})
    comp.add_kernel("n2", "rmsnorm", norm.shape({"tokens": t, "hidden": n, "residual": False}),
                    inputs={"x": "g"}, outputs={"y": "out"})
    comp.build()
    prog = kb.build()
    check_program(prog, TINY)
    (w,) = [a for a in prog.allocations if a.space is Space.HBM and a.name == "g/w"]
    ranges = dict(dict(prog.meta)["regions"])["g"]
    queues = []  # per part of the region: the queues its weight-chunk loads are on
    for a, b in ranges:
        qs = {ins.engine.queue for ins in prog.instructions[a:b] if ins.mnemonic == "dma.load"
              and w.offset <= ins.arg("src").offset < w.offset + w.nbytes}
        queues.append(qs)
    last = TINY.dma.queues_per_core - 1
    assert queues[0] == {FUSED_PREFETCH_QUEUE}
    assert set().union(*queues[1:]) == {last}
    rng = np.random.default_rng(2)
    data = {"x": rng.standard_normal((t, h)).astype(BF16), "res": rng.standard_normal((t, h)).astype(BF16),
            "n1/w": (1 + 0.1 * rng.standard_normal((1, h))).astype(BF16),
            "g/w": (0.05 * rng.standard_normal((h, n))).astype(BF16),
            "n2/w": (1 + 0.1 * rng.standard_normal((1, n))).astype(BF16)}
    got = run_functional(prog, {**data, **comp.ctx.consts}).read("n2/y", "bf16", (t, n))
    y1, _ = rmsnorm_reference(data["x"], data["res"], data["n1/w"], 1e-5)
    want, _ = rmsnorm_reference(gemm_reference(np.asarray(y1), data["g/w"], None), None, data["n2/w"], 1e-5)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    # a stand-alone launch (output in HBM) keeps slot s on queue s % load_queues
    alone = gemm.build(gemm.shape({"m": t, "n": n, "k": h, "weight_fmt": "bf16", "act_fmt": "bf16",
                                   "bias": False}), TINY).program
    (wa,) = [a for a in alone.allocations if a.space is Space.HBM and a.name == "w"]
    assert {ins.engine.queue for ins in alone.instructions if ins.mnemonic == "dma.load"
            and wa.offset <= ins.arg("src").offset < wa.offset + wa.nbytes} == {0, 1}


def test_a_region_skips_fences_an_earlier_fence_implies_and_still_checks():
    """Region b waited for a's done condition before signalling its own, so a region fenced by
    both waits for b's alone; the program still checks (the order is transitive)."""
    kb = KernelBuilder("chain", chip=TINY)
    x = kb.hbm("x", (8, 64), "f32")
    c0, c1 = kb.core(0), kb.core(1)
    with kb.region("a") as ra:
        buf = kb.sram(0, "buf", (8, 64), "f32")
        c0.dma[0].load(buf, x)
    a_done = ra.close()
    with kb.region("b", fences=((a_done[0].id, a_done[1]),)) as rb:
        c0.vpu.exp(buf, buf)
    b_done = rb.close()
    fences = ((a_done[0].id, a_done[1]), (b_done[0].id, b_done[1]))
    with kb.region("c", fences=fences) as rc:
        c0.vpu.exp(buf, buf)
        other = kb.sram(1, "other", (8, 64), "f32")
        c1.dma[0].load(other, x)
    assert rc.fences == [(b_done[0].id, b_done[1])]
    waits = [i for i in kb._instructions if i.mnemonic == "sem.wait" and i.source == "c:fence"]
    assert len(waits) == 2 and {w.arg("sem") for w in waits} == {b_done[0].id}  # one per engine
    c_done = rc.close()
    # a fence added later that implies an earlier one: engines entering afterwards skip the earlier
    with kb.region("d", fences=((a_done[0].id, a_done[1]),)) as rd:
        c0.vpu.exp(buf, buf)
        rd.add_fences([(c_done[0].id, c_done[1])])
        c1.vpu.exp(kb.sram(1, "more", (8, 64), "f32"), other)
    late = [i for i in kb._instructions if i.mnemonic == "sem.wait" and i.source == "d:fence"
            and i.engine.core == 1]
    assert [w.arg("sem") for w in late] == [c_done[0].id]
    check_program(kb.build(), TINY)


def _region(name: str) -> SimpleNamespace:
    """What Arena.alloc reads of a region: its name."""
    return SimpleNamespace(name=name)


def _middle_old_arena(cap: int, small: int) -> Arena:
    """An arena of one core whose only old free memory (released two releases ago and more) is a
    ``small``-byte block in the middle: [0, m) and [m + small, cap) were freed last."""
    arena = Arena(TINY)
    m = cap // 2 - small
    r = [_region(n) for n in ("r1", "r2", "r3")]
    for region, nbytes in zip(r, (m, small, cap - m - small), strict=True):
        arena.alloc(Space.SRAM, 0, nbytes, 64, region, keep=False)
    for k, name in enumerate(("r2", "r1", "r3")):
        arena.release(name, frozenset({(900 + k, 1)}))
    return arena


def test_first_fit_places_what_the_preference_for_old_memory_cannot():
    cap, small = TINY.sram.scratchpad_bytes, 4096
    big = cap // 2 + 8192  # larger than either run around the middle block
    region = _region("op")
    arena = _middle_old_arena(cap, small)
    assert arena.alloc(Space.SRAM, 0, small, 64, region, keep=False)[0] == cap // 2 - small
    with pytest.raises(ArenaFull):
        arena.alloc(Space.SRAM, 0, big, 64, region, keep=False)
    arena = _middle_old_arena(cap, small)
    arena.first_fit = True
    assert arena.alloc(Space.SRAM, 0, small, 64, region, keep=False)[0] == 0
    start, fences = arena.alloc(Space.SRAM, 0, big, 64, region, keep=False)
    assert start == small and fences == {(900, 1), (901, 1), (902, 1)}  # it waits for all three


def test_an_operator_that_fits_by_first_fit_is_not_replanned():
    """Before re-planning an operator at its own turn, the composer places it again by plain
    first fit (Kimi K2.5's MoE at batch 64 was re-planned to a program 2.5x slower)."""
    cap, small = TINY.sram.scratchpad_bytes, 4096

    def emit(ctx):
        ctx.kb.sram(0, "small", (small // 4, 1), "f32")
        ctx.kb.sram(0, "big", ((cap // 2 + 8192) // 4, 1), "f32")
        yield {}

    kb = KernelBuilder("first_fit", chip=TINY)
    comp = Composer(kb, TINY, lookahead=0)
    comp.arena = _middle_old_arena(cap, small)
    op = comp.add("op", emit)
    comp.build()
    assert not op.replanned and not comp.arena.first_fit  # (the flag is only for the retry)
    big = next(a for a in kb.build().allocations if a.name.endswith("big"))
    assert big.offset == small


def test_kept_outputs_go_to_the_top_and_leave_one_run_below():
    cap = TINY.sram.scratchpad_bytes
    arena = Arena(TINY)
    region = _region("op")
    assert arena.alloc(Space.SRAM, 0, 1000, 64, region, keep=True)[0] == (cap - 1000) // 64 * 64
    assert arena.alloc(Space.SRAM, 0, 1000, 64, region, keep=False)[0] == 0
    second = arena.alloc(Space.SRAM, 0, 4096, 64, region, keep=True)[0]
    assert second == (cap - 1000) // 64 * 64 - 4096  # right below the first
    assert arena.largest_free(1)[Space.SRAM] == second - 1000  # one run between the two ends


def test_a_kept_output_takes_recent_memory_at_the_top_over_old_memory_low_down():
    cap = TINY.sram.scratchpad_bytes

    def arena_with_old(lo: int, hi: int) -> Arena:
        """Old memory [lo, hi), the rest of the scratchpad freed in the last two releases."""
        arena = Arena(TINY)
        spans = [("below", 0, lo), ("old", lo, hi), ("above", hi, cap)]
        for name, a, b in spans:
            if b > a:
                arena.alloc(Space.SRAM, 0, b - a, 64, _region(name), keep=False)
        for k, name in enumerate(("old", "below", "above")):
            arena.release(name, frozenset({(800 + k, 1)}))
        return arena

    region = _region("norm")
    top = (cap - 1000) // 64 * 64
    # old memory only in the lower half: the top, though freed recently
    assert arena_with_old(0, cap // 4).alloc(Space.SRAM, 0, 1000, 64, region, keep=True) == (
        top, frozenset({(802, 1)}))
    # old memory in the upper half: its top, no fence on a recent region
    start, fences = arena_with_old(cap // 2, 3 * cap // 4).alloc(Space.SRAM, 0, 1000, 64, region, keep=True)
    assert start == (3 * cap // 4 - 1000) // 64 * 64 and fences == {(800, 1)}
