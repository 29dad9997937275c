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
