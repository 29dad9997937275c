"""The builder checks each instruction signature once but still rejects every illegal one."""

import pytest

from jalapeno_emu.errors import IllegalInstruction
from jalapeno_emu.isa.builder import KernelBuilder


def test_an_illegal_instruction_is_caught_even_after_legal_ones_of_the_same_kind():
    kb = KernelBuilder("k", chip="tiny")
    a = kb.sram(0, "a", (8, 64), "f32")
    b = kb.sram(0, "b", (8, 64), "f32")
    c = kb.sram(0, "c", (8, 32), "f32")
    for _ in range(3):
        kb.core(0).vpu.add(a, a, b)  # same signature: checked once
    with pytest.raises(IllegalInstruction, match="rule"):
        kb.core(0).vpu.add(a, a, c)  # differs only in a shape: checked, and refused
    with pytest.raises(IllegalInstruction):
        kb.core(1).vpu.add(a, a, b)  # same operands, another core's engine: refused


def test_integer_operands_are_cached_by_their_side_of_every_rule_constant():
    kb = KernelBuilder("k", chip="tiny")
    done = kb.semaphore("done")
    vpu = kb.core(0).vpu
    for value in range(1, 50):  # one legality check for all of them
        vpu.wait(done, value)
    with pytest.raises(IllegalInstruction, match="value >= 1"):
        vpu.wait(done, 0)
    with pytest.raises(IllegalInstruction, match="value >= 1"):
        vpu.wait(done, -3)
    with pytest.raises(IllegalInstruction, match="signed 64-bit"):
        vpu.wait(done, 2**63)
    vpu.signal(done, 1)
    with pytest.raises(IllegalInstruction, match="must be an integer"):
        vpu.signal(done, True)  # equal to 1 and hashes like it, but not an integer operand
    with pytest.raises(IllegalInstruction, match="must be an integer"):
        vpu.signal(done, 1.0)
    assert len(kb.build().instructions) == 50


def test_tiles_with_non_integer_fields_or_huge_offsets_are_checked_on_their_own():
    from jalapeno_emu.isa.program import Tile
    from jalapeno_emu.isa.table import Space

    kb = KernelBuilder("k", chip="tiny")
    dst = kb.sram(0, "dst", (2, 64), "f32")
    dma = kb.core(0).dma[0]
    dma.load(dst, Tile(Space.HBM, 0, 4096, "f32", 2, 64))
    with pytest.raises(IllegalInstruction, match="offset"):
        dma.load(dst, Tile(Space.HBM, 0, 2**64, "f32", 2, 64))  # same shape, offset beyond its field
    with pytest.raises(IllegalInstruction, match="rows"):
        dma.load(dst, Tile(Space.HBM, 0, 4096, "f32", 2.0, 64))  # == 2, but not an integer


def test_integer_points_cover_the_rule_constants_and_field_bounds():
    from jalapeno_emu.isa.legality import integer_points
    from jalapeno_emu.isa.table import InstrSpec, OperandSpec, by_mnemonic

    points = integer_points(by_mnemonic("sem.wait"))
    assert points["value"] == (-(2**63), 0, 1, 2**63 - 1)
    assert points["sem"] == (0, 1, 2**32 - 1)
    row = InstrSpec("x.y", 0xFF, "any", (OperandSpec("a", "imm"), OperandSpec("b", "imm"),
                                        OperandSpec("c", "imm")), "sync", "",
                    rules=("a <= b", "c - 1 >= 0", "b >= 0"))
    assert integer_points(row) == {}  # compared with another operand, or in arithmetic: exact values


def test_one_check_covers_every_core_but_core_mismatches_are_still_refused():
    from jalapeno_emu.isa.program import Tile
    from jalapeno_emu.isa.table import Space

    kb = KernelBuilder("k", chip="tiny")
    x = kb.hbm("x", (2, 64), "f32")
    bufs = [kb.sram(c, "buf", (2, 64), "f32") for c in range(2)]
    for c in range(2):
        kb.core(c).dma[0].load(bufs[c], x)  # the same check, relative to each engine's core
    with pytest.raises(IllegalInstruction, match=r"dst\.core == core"):
        kb.core(1).dma[0].load(bufs[0], x)  # another core's SRAM
    with pytest.raises(IllegalInstruction, match="HBM tile with core 1"):
        kb.core(1).dma[0].load(bufs[1], Tile(Space.HBM, 1, x.offset, "f32", 2, 64))


def test_cores_are_keyed_as_they_are_when_a_rule_does_more_than_compare_them():
    import dataclasses

    from jalapeno_emu.isa.legality import cores_only_compared_with_cores
    from jalapeno_emu.isa.table import by_mnemonic

    load = by_mnemonic("dma.load")
    assert cores_only_compared_with_cores(load)
    for rule in ("dst.core + 1 == core", "dst.core < core", "core in (dst.core, 3)", "dst.core == 0"):
        assert not cores_only_compared_with_cores(dataclasses.replace(load, rules=(rule,)))
