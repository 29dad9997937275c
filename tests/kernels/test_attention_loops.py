"""The flash-attention engine (and MLA's flash loop) issue the steady KV tiles of a unit (whole
rounds of its buffers) as hardware loops: the same instructions per engine as the unrolled
program, the same timing to the instruction, the same output bits, and a program that passes
the checker."""

from __future__ import annotations

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.chip.load import apply_overrides
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.costs import ProgramFacts
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.isa.builder import unrolled_loops
from jalapeno_emu.kernels import get_kernel, run_kernel


def _streams(program) -> dict:
    out: dict = {}
    for ins in program.instructions:
        out.setdefault(ins.engine, []).append((ins.mnemonic, ins.args))
    return out


@pytest.mark.parametrize("kernel, preset_kib, keys", [
    # 256 new tokens over 512 cached: every query tile walks the prior context in 32-token tiles
    ("attention-prefill", None, {"seq": 256, "prior": 512, "q_heads": 2, "kv_heads": 1, "head_dim": 64}),
    # a GPU-sized scratchpad: the lean plan (one query slot, heads split over units), sinks
    ("attention-prefill", 176, {"seq": 64, "prior": 1024, "q_heads": 4, "kv_heads": 1, "head_dim": 64,
                                "sinks": True}),
    # decode over 2048 cached tokens in 32-token tiles on a small scratchpad
    ("attention-decode", 64, {"context": 2048, "q_heads": 2, "kv_heads": 1, "head_dim": 64}),
    # MLA's flash loop: on-core prefill (the whole K_h, V_h in SRAM), and the small-scratchpad
    # path (KV tiles streamed through rotating buffers)
    ("mla-prefill", None, {"seq": 64, "prior": 512, "q_heads": 2, "kv_tile": 32}),
    ("mla-prefill", 64, {"seq": 32, "prior": 1024, "q_heads": 2}),
    ("mla-decode", None, {"context": 1024, "kv_tile": 32}),
    ("mla-decode", 64, {"context": 2048}),
])
def test_kv_loops_run_time_and_check_as_unrolled(kernel, preset_kib, keys):
    spec = load_preset("tiny")
    if preset_kib:
        spec = apply_overrides(spec, [f"sram.scratchpad_bytes={preset_kib}KiB"])
    kdef = get_kernel(kernel)
    shape = kdef.shape(keys)
    looped = kdef.build(shape, spec)
    with unrolled_loops():
        plain = kdef.build(shape, spec)
    assert looped.program.loops and not plain.program.loops
    assert len(looped.program.items) < plain.program.n_instructions == looped.program.n_instructions
    assert _streams(looped.program) == _streams(plain.program)
    check_program(looped.program, spec)

    tl, tu = run_timing(looped.program, spec), run_timing(plain.program, spec)
    assert tl.summary() == tu.summary()
    fl, fu = ProgramFacts(looped.program), ProgramFacts(plain.program)
    for sl, su in zip(fl.streams, fu.streams, strict=True):
        assert np.array_equal(tl.start_s[sl], tu.start_s[su]) and np.array_equal(tl.end_s[sl], tu.end_s[su])

    inputs = looped.make_inputs(0)
    got = run_functional(looped.program, inputs).read("out", *looped.outputs["out"], space="hbm")
    want = run_functional(plain.program, inputs).read("out", *plain.outputs["out"], space="hbm")
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    report = run_kernel(kernel, keys, preset=spec, check=True)
    assert report.check["passed"], report.check


def test_units_shorter_than_four_rounds_are_issued_unrolled():
    """A loop needs four whole rounds of the KV slots past a unit's first two tiles (its query
    load and output start) and before its masked diagonal tile; shorter units are unrolled."""
    spec = load_preset("tiny")
    kdef = get_kernel("attention-prefill")
    # 32-token query tiles over 64 cached tokens: each unit has 2 prior tiles + at most 8
    # chunk tiles, fewer than 4 rounds of 6 slots, so nothing loops
    keys = {"seq": 256, "prior": 64, "q_heads": 2, "kv_heads": 1, "head_dim": 64}
    short = kdef.build(kdef.shape(keys), spec)
    assert not short.program.loops
