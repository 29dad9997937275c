"""Mistakes in builder calls (issue 13) are the project's errors, naming what to write instead:
a DMA queue past the chip's count, an instruction method called with the wrong operands, an
unknown instruction name."""

import re

import pytest

from jalapeno_emu.errors import EmuError, IllegalInstruction, InvalidArgumentError, InvalidTypeError
from jalapeno_emu.isa.builder import KernelBuilder


@pytest.fixture
def kb():
    return KernelBuilder("k", chip="tiny")


def test_a_dma_queue_past_the_count_names_the_count_and_the_preset(kb):
    core = kb.core(0)
    n = kb.chip.dma.queues_per_core
    message = f"dma[{n}] does not exist: core 0 of tiny has {n} DMA queues"
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        core.dma[n]
    with pytest.raises(InvalidTypeError, match="must be an integer"):
        core.dma["0"]
    # still a list: negative indices, slices, len and iteration work as before
    assert core.dma[-1] is core.dma[n - 1] and len(core.dma[:2]) == 2 and len(list(core.dma)) == n


def test_a_short_form_called_wrongly_names_the_instruction_not_a_closure(kb):
    b = kb.sram(0, "b", (8, 64), "f32")
    vpu = kb.core(0).vpu
    message = """vpu.exp(dst, src), short for vec.unary("exp", dst, src): operand 'src' missing"""
    with pytest.raises(IllegalInstruction, match=re.escape(message)) as info:
        vpu.exp(b)
    assert "method" not in str(info.value) and "test_builder_errors.py" in str(info.value)
    with pytest.raises(IllegalInstruction, match=r'vec.binary\("add", dst, a, b\): got 4 operands'):
        vpu.add(b, b, b, b)
    with pytest.raises(IllegalInstruction, match="the operation is 'exp' already"):
        vpu.exp(b, b, op="exp")
    vpu.exp(dst=b, src=b)  # keywords still work
    assert len(kb.build().instructions) == 1


def test_a_generic_method_called_wrongly_shows_the_operands(kb):
    b = kb.sram(0, "b", (8, 64), "f32")
    message = "dma.load takes at most 2 operands, got 3: dma.load(dst, src)"
    with pytest.raises(IllegalInstruction, match=re.escape(message)):
        kb.core(0).dma[0].load(b, b, b)
    with pytest.raises(IllegalInstruction, match=r"needs operand 'count': barrier\(id, count\)"):
        kb.core(0).vpu.barrier(0)


def test_an_unknown_instruction_suggests_what_to_write(kb):
    vpu = kb.core(0).vpu
    with pytest.raises(AttributeError, match=r'write reduce\("sum", dst, src\)'):
        getattr(vpu, "sum")  # noqa: B009 - the attribute access is what is tested
    with pytest.raises(AttributeError, match="did you mean exp"):
        getattr(vpu, "exq")  # noqa: B009
    with pytest.raises(AttributeError, match=r"instruction of the mxu unit: core.mxu.matmul"):
        getattr(vpu, "matmul")  # noqa: B009
    with pytest.raises(IllegalInstruction, match=re.escape('did you mean vec.unary with op="exp"')):
        vpu.issue("vec.exp")
    assert not hasattr(vpu, "__deepcopy__")  # protocol probes stay plain AttributeErrors
    assert issubclass(InvalidArgumentError, EmuError)
