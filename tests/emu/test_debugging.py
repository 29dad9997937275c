"""The debugging surface: reading any named buffer back after a run, and ``probe`` instructions
that record a tile's value at a point of the program (issue 13). Tiny shapes on the tiny preset."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.errors import (
    AssemblyError,
    IllegalInstruction,
    InvalidArgumentError,
    Race,
    UninitializedRead,
)
from jalapeno_emu.isa import assemble, decode_program, disassemble, encode_program
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.table import LABEL_MAX_CHARS, Space

TINY = load_preset("tiny")
R, C = 8, 64


def _x(seed: int = 0, rows: int = R, cols: int = C) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def _exp_kernel(*, probes: bool = True, cores: int = 2, preset: str = "tiny"):
    """Each core loads its [R, C] slice of x into its own scratchpad buffer "buf", probes it,
    exponentiates it in place, probes it again, reduces a row max into "rowmax" and stores it."""
    kb = KernelBuilder("exp_probe", chip=preset)
    x = kb.hbm("x", (R * cores, C), "f32")
    y = kb.hbm("y", (R * cores, 1), "f32")
    for c in range(cores):
        buf, rowmax = kb.sram(c, "buf", (R, C), "f32"), kb.sram(c, "rowmax", (R, 1), "f32")
        loaded, done = kb.semaphore(f"loaded{c}"), kb.semaphore(f"done{c}")
        core = kb.core(c)
        core.dma[0].load(buf, x.sub(R * c, 0, R, C))
        core.dma[0].signal(loaded)
        core.vpu.wait(loaded, 1)
        if probes:
            core.vpu.probe(buf, "before exp")
        core.vpu.exp(buf, buf)
        if probes:
            core.vpu.probe(buf, "after exp")
        core.vpu.reduce("max", rowmax, buf)
        core.vpu.signal(done)
        core.dma[1].wait(done, 1)
        core.dma[1].store(y.sub(R * c, 0, R, 1), rowmax)
    return kb.build()


# --- reading buffers by name ----------------------------------------------------------------
def test_an_sram_buffer_reads_back_by_name_with_its_recorded_dtype_and_shape():
    program = _exp_kernel(cores=1)
    x = _x(0)
    result = run_functional(program, {"x": x})
    rowmax = result.read("rowmax")
    assert rowmax.dtype == np.float32 and rowmax.shape == (R, 1)
    want = np.asarray(jnp.exp(x))
    np.testing.assert_array_equal(rowmax, want.max(axis=1, keepdims=True))
    np.testing.assert_array_equal(result.read("buf"), want)
    np.testing.assert_array_equal(result.read("y"), rowmax)  # HBM still reads as before
    assert result.read_bytes("rowmax").tobytes() == rowmax.tobytes()


def test_a_per_core_buffer_reads_with_core_and_the_ambiguity_names_the_cores():
    program = _exp_kernel(cores=2)
    x = _x(1, 2 * R)
    result = run_functional(program, {"x": x})
    for c in range(2):
        np.testing.assert_array_equal(result.read("buf", core=c), np.asarray(jnp.exp(x[R * c:R * (c + 1)])))
    with pytest.raises(InvalidArgumentError, match=r"sram 'buf' exists on cores 0, 1; pass core="):
        result.read("buf")
    with pytest.raises(InvalidArgumentError, match=r"pass core="):
        result.read_bytes("rowmax")
    with pytest.raises(InvalidArgumentError, match=r"no allocation named 'buf' on core 5; 'buf' is in sram"):
        result.read("buf", core=5)


def test_ambiguity_over_many_cores_is_written_as_a_range():
    program = _exp_kernel(cores=8, preset="jalapeno-v1", probes=False)
    kb_cores = {a.core for a in program.allocations if a.name == "rowmax"}
    assert kb_cores == set(range(8))
    result = run_functional(program, {"x": _x(2, 8 * R)})
    with pytest.raises(InvalidArgumentError, match=r"sram 'rowmax' exists on cores 0\.\.7; pass core="):
        result.read("rowmax")
    assert result.read("rowmax", core=7).shape == (R, 1)


def _acc_kernel():
    """A bf16 matmul into accumulators "c" (probed on the matrix unit right after it), read out."""
    kb = KernelBuilder("acc_probe", chip="tiny")
    a_h, b_h = kb.hbm("a", (8, 32), "bf16"), kb.hbm("b", (32, 16), "bf16")
    a, b, acc = kb.sram(0, "a", (8, 32), "bf16"), kb.sram(0, "b", (32, 16), "bf16"), kb.acc(0, "c", (8, 16))
    loaded = kb.semaphore("loaded")
    core = kb.core(0)
    core.dma[0].load(a, a_h)
    core.dma[0].load(b, b_h)
    core.dma[0].signal(loaded)
    core.mxu.wait(loaded, 1)
    core.mxu.matmul(acc, a, b, mode="overwrite")
    core.mxu.probe(acc, "first product")
    core.mxu.matmul(acc, a, b)
    core.mxu.probe(acc, "doubled")
    return kb.build()


def test_accumulators_read_back_and_probe_on_the_matrix_unit_without_a_semaphore():
    program = _acc_kernel()
    check_program(program, TINY)  # a probe in the matrix unit's own order needs no semaphore
    rng = np.random.default_rng(3)
    a = rng.integers(-4, 5, (8, 32)).astype(ml_dtypes.bfloat16)  # small integers: exact sums
    b = rng.integers(-4, 5, (32, 16)).astype(ml_dtypes.bfloat16)
    result = run_functional(program, {"a": a, "b": b})
    want = a.astype(np.float32) @ b.astype(np.float32)
    acc = result.read("c")
    assert acc.dtype == np.float32 and acc.shape == (8, 16)
    np.testing.assert_array_equal(acc, 2 * want)
    np.testing.assert_array_equal(result.read("c", space="acc", core=0), 2 * want)
    [first], [doubled] = result.probes["first product"], result.probes["doubled"]
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(doubled, 2 * want)
    assert result.read("a", space=Space.SRAM).dtype == ml_dtypes.bfloat16


def test_an_hbm_name_means_the_tensor_unless_space_or_core_says_otherwise():
    program = _acc_kernel()  # "a" and "b" are HBM tensors and scratchpad buffers of core 0
    rng = np.random.default_rng(4)
    a = rng.integers(-4, 5, (8, 32)).astype(ml_dtypes.bfloat16)
    b = rng.integers(-4, 5, (32, 16)).astype(ml_dtypes.bfloat16)
    result = run_functional(program, {"a": a, "b": b})
    hbm, sram = result.buffers["hbm:a"], result.buffers["sram:0"]
    assert result.read_bytes("a") is hbm  # what read("a") has always meant
    assert np.shares_memory(result.read_bytes("a", core=0), sram)
    assert np.shares_memory(result.read_bytes("a", space="sram"), sram)
    np.testing.assert_array_equal(result.read("a", space="hbm"), a)
    np.testing.assert_array_equal(result.read("a", space=Space.SRAM), a)
    assert result.read_bytes("b", core=0).tobytes() == b.tobytes()
    with pytest.raises(InvalidArgumentError, match=r"space='l2' is not one of hbm, sram, acc"):
        result.read("a", space="l2")
    with pytest.raises(InvalidArgumentError, match=r"core=-1 is not a core number"):
        result.read("a", core=-1)


def test_one_name_in_two_spaces_of_a_core_needs_space():
    kb = KernelBuilder("twice", chip="tiny")
    t = kb.sram(1, "t", (2, 16), "f32")
    kb.acc(1, "t", (2, 16))
    kb.sram(0, "t", (2, 16), "f32")
    x = kb.hbm("x", (2, 16), "f32")
    kb.core(1).dma[0].load(t, x)
    result = run_functional(kb.build(), {"x": np.ones((2, 16), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"'t' exists in sram on cores 0, 1 and acc on core 1; "
                                                   r"pass space= \(sram, acc\) and core="):
        result.read("t")
    with pytest.raises(InvalidArgumentError, match=r"'t' exists in sram on core 1 and acc on core 1; "
                                                   r"pass space= \(sram, acc\)$"):
        result.read("t", core=1)
    np.testing.assert_array_equal(result.read("t", core=1, space="sram"), np.ones((2, 16), np.float32))
    assert result.read("t", space="acc").shape == (2, 16)


def test_an_unknown_name_lists_what_exists_and_names_lists_everything():
    result = run_functional(_exp_kernel(cores=1), {"x": _x(5)})
    with pytest.raises(InvalidArgumentError) as info:
        result.read("rowmx")
    text = str(info.value)
    assert "no allocation named 'rowmx'; the program has hbm x f32[8,64]" in text
    assert "sram[0] rowmax f32[8,1]" in text and "did you mean 'rowmax'?" in text
    listed = [str(r) for r in result.names()]
    assert listed == ["hbm x f32[8,64] (2,048 B)", "hbm y f32[8,1] (32 B)",
                      "sram[0] buf f32[8,64] (2,048 B)", "sram[0] rowmax f32[8,1] (32 B)"]
    assert [r.name for r in result.names(space="sram")] == ["buf", "rowmax"]


def test_a_long_listing_is_clipped():
    kb = KernelBuilder("many", chip="tiny")
    for i in range(40):
        kb.sram(0, f"b{i}", (1, 16), "f32")
    result = run_functional(kb.build())
    with pytest.raises(InvalidArgumentError,
                       match=r"and 28 more \(FunctionalResult.names\(\) lists them all\)"):
        result.read("nothing")


def test_assembled_programs_read_on_chip_buffers_given_dtype_and_shape():
    text = """
.alloc sram[0] buf 0x0 256
.alloc hbm buf 0x0 256
.init buf ones f32
c0.dma0: dma.load sram[0]:0x0:f32[8,8], hbm:0x0:f32[8,8]
"""
    result = run_functional(assemble(text))
    with pytest.raises(InvalidArgumentError, match="give dtype= and shape="):
        result.read("buf", space="sram")
    np.testing.assert_array_equal(result.read("buf", "f32", (8, 8), space="sram"),
                                  np.ones((8, 8), np.float32))
    with pytest.raises(InvalidArgumentError, match="needs 1,024 B; the allocation holds 256 B"):
        result.read("buf", "f32", (16, 16), space="sram")


# --- probes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("compile_mode", ["instruction", "program"])
def test_probes_record_the_value_before_and_after_an_in_place_exp(compile_mode):
    program = _exp_kernel(cores=2)
    check_program(program, TINY)
    x = _x(6, 2 * R)
    result = run_functional(program, {"x": x}, compile=compile_mode)
    before, after = result.probes["before exp"], result.probes["after exp"]
    assert len(before) == len(after) == 2  # one per core, in issue order
    for c in range(2):
        part = x[R * c:R * (c + 1)]
        np.testing.assert_array_equal(before[c], part)
        np.testing.assert_array_equal(after[c], np.asarray(jnp.exp(part)))
    assert [site[1] for site in result.probe_sites["after exp"]] == ["c0.vpu", "c1.vpu"]
    assert all(site[2].startswith("test_debugging.py:") for site in result.probe_sites["after exp"])


def test_probes_of_one_label_come_back_in_program_order_and_decode_like_read():
    kb = KernelBuilder("loop", chip="tiny")
    x = kb.hbm("x", (R, C), "f32")
    buf, codes, scales = kb.sram(0, "buf", (R, C), "f32"), kb.sram(0, "q", (R, C), "fp4"), \
        kb.sram(0, "qs", (R, C // 32), "e8m0")
    loaded = kb.semaphore("loaded")
    core = kb.core(0)
    core.dma[0].load(buf, x)
    core.dma[0].signal(loaded)
    core.vpu.wait(loaded, 1)
    for _ in range(3):
        core.vpu.scale(buf, buf, 2.0)
        core.vpu.probe(buf.sub(0, 0, 2, C), "rows 0-1")
    core.vpu.quantize(codes, scales, buf)
    core.vpu.probe(codes, "codes")
    program = kb.build()
    check_program(program, TINY)
    x_in = _x(7)
    result = run_functional(program, {"x": x_in})
    assert [p.shape for p in result.probes["rows 0-1"]] == [(2, C)] * 3
    for i, got in enumerate(result.probes["rows 0-1"]):
        np.testing.assert_array_equal(got, x_in[:2] * 2.0 ** (i + 1))
    [codes_seen] = result.probes["codes"]
    assert codes_seen.dtype == np.uint8 and codes_seen.shape == (R, C)  # fp4 unpacked to codes
    np.testing.assert_array_equal(codes_seen, result.read("q"))


def test_a_probe_on_a_dma_queue_and_on_the_link_engine_of_hbm():
    kb = KernelBuilder("hbm_probe", chip="tiny")
    x = kb.hbm("x", (R, C), "f32")
    kb.core(1).dma[2].probe(x, "x on entry")
    kb.link.probe(x.sub(0, 0, 1, C), "row 0")
    program = kb.build()
    check_program(program, TINY)
    x_in = _x(8)
    result = run_functional(program, {"x": x_in})
    np.testing.assert_array_equal(result.probes["x on entry"][0], x_in)
    np.testing.assert_array_equal(result.probes["row 0"][0], x_in[:1])
    run_timing(program, TINY)  # engines with nothing but probes time (to nothing) too


@pytest.mark.parametrize("bad", ["", " padded", "two\nlines", "tab\there", "x" * (LABEL_MAX_CHARS + 1), 7,
                                 "\ud800"])
def test_labels_are_validated_with_the_projects_errors(bad):
    kb = KernelBuilder("bad_label", chip="tiny")
    buf = kb.sram(0, "buf", (R, C), "f32")
    with pytest.raises(IllegalInstruction, match=r"probe operand label"):
        kb.core(0).vpu.probe(buf, bad)


def test_the_longest_label_is_accepted_and_a_bad_one_in_assembly_points_at_its_column():
    kb = KernelBuilder("ok_label", chip="tiny")
    buf = kb.sram(0, "buf", (R, C), "f32")
    kb.core(0).vpu.probe(buf, "é" * LABEL_MAX_CHARS)
    with pytest.raises(AssemblyError, match=r"k.jasm:1:37: probe operand label is empty"):
        assemble('c0.vpu: probe sram[0]:0x0:f32[1,8], ""', source="k.jasm")


def test_unordered_probes_are_races_and_ordered_ones_are_not():
    def build(order: bool, on_queue: bool = False):
        kb = KernelBuilder("race", chip="tiny")
        x, buf = kb.hbm("x", (R, C), "f32"), kb.sram(0, "buf", (R, C), "f32")
        loaded = kb.semaphore("loaded")
        core = kb.core(0)
        core.dma[0].load(buf, x)
        core.dma[0].signal(loaded)
        engine = core.dma[0] if on_queue else core.vpu
        if order:
            engine.wait(loaded, 1)
        engine.probe(buf, "buf")
        return kb.build()

    check_program(build(order=True), TINY)
    check_program(build(order=True, on_queue=True), TINY)
    with pytest.raises(Race) as info:
        check_program(build(order=False), TINY)
    assert (info.value.index, info.value.engine) == (2, "c0.vpu")
    assert "operand src" in str(info.value) and "#0 on c0.dma0 (dma.load" in str(info.value)
    # On the loading queue itself: the queue's transfers are unordered with what follows them.
    with pytest.raises(Race) as info:
        check_program(build(order=False, on_queue=True), TINY)
    assert (info.value.index, info.value.engine) == (2, "c0.dma0") and "dma.load" in str(info.value)


def test_a_probe_of_never_written_scratchpad_is_an_uninitialised_read():
    kb = KernelBuilder("uninit", chip="tiny")
    kb.core(0).vpu.probe(kb.sram(0, "buf", (R, C), "f32"), "garbage")
    with pytest.raises(UninitializedRead, match=r"operand src reads") as info:
        check_program(kb.build(), TINY)
    assert (info.value.index, info.value.engine) == (0, "c0.vpu")


def test_a_probe_round_trips_through_assembly_and_the_binary_format():
    program = _exp_kernel(cores=2)
    kb = KernelBuilder("labels", chip="tiny")
    buf = kb.sram(0, "buf", (R, C), "f32")
    kb.core(0).vpu.exp(buf, buf)
    for label in ('rowmax, after "exp" [c0]', "x; y # z", "Jalapeño"):
        kb.core(0).vpu.probe(buf, label)
    for p in (program, kb.build()):
        text = disassemble(p)
        again = assemble(text, source="again.jasm")
        strip = [dataclasses.replace(i, source="") for i in p.instructions]
        assert [dataclasses.replace(i, source="") for i in again.instructions] == strip
        data = encode_program(again, sources=False)
        assert encode_program(assemble(disassemble(decode_program(data))), sources=False) == data
        assert decode_program(encode_program(p)) == p
    assert 'probe sram[0]:0x0:f32[8,64], "rowmax, after \\"exp\\" [c0]"' in disassemble(kb.build())


def _busy_kernel(probes: bool):
    """Two queues loading at once (the one issued first is not the first engine), back-to-back
    matmuls, vector work and a store: probes everywhere, including ahead of everything on a queue."""
    kb = KernelBuilder("busy", chip="tiny")
    big, small = kb.hbm("big", (64, 256), "bf16"), kb.hbm("small", (32, 64), "bf16")
    out = kb.hbm("out", (32, 64), "f32")
    a, b = kb.sram(0, "a", (64, 256), "bf16"), kb.sram(0, "b", (32, 64), "bf16")
    acc, o = kb.acc(0, "acc", (32, 256)), kb.sram(0, "o", (32, 64), "f32")
    s_a, s_b, s_mm, s_v = (kb.semaphore(n) for n in ("a", "b", "mm", "v"))
    core = kb.core(0)
    if probes:
        core.dma[0].probe(small, "first of all")  # queue 0's first instruction, issued first
    core.dma[1].load(a, big)  # issued before queue 0's load, on a later engine
    core.dma[1].signal(s_a)
    core.dma[0].load(b, small)
    if probes:
        core.dma[0].probe(small, "between transfers")
    core.dma[0].signal(s_b)
    core.mxu.wait(s_a, 1)
    core.mxu.wait(s_b, 1)
    core.mxu.matmul(acc, b, a, mode="overwrite")
    if probes:
        core.mxu.probe(acc, "between matmuls")
    core.mxu.matmul(acc, b, a)  # back to back: no second pipeline fill, with or without the probe
    core.mxu.signal(s_mm)
    core.vpu.wait(s_mm, 1)
    core.vpu.acc_read(o, acc.sub(0, 0, 32, 64))
    if probes:
        core.vpu.probe(o, "o")
    core.vpu.exp(o, o)
    core.vpu.signal(s_v)
    core.dma[2].wait(s_v, 1)
    if probes:
        core.dma[2].probe(o, "o, on the store queue")
    core.dma[2].store(out, o)
    return kb.build()


def test_timing_is_identical_with_and_without_probes():
    plain, probed = _busy_kernel(False), _busy_kernel(True)
    check_program(probed, TINY)
    t0, t1 = run_timing(plain, TINY), run_timing(probed, TINY)
    keep = [i for i, ins in enumerate(probed.instructions) if ins.mnemonic != "probe"]
    assert len(keep) == len(plain.instructions) and len(probed.instructions) - len(keep) == 5
    np.testing.assert_array_equal(t1.start_s[keep], t0.start_s)
    np.testing.assert_array_equal(t1.end_s[keep], t0.end_s)
    assert t1.time_s == t0.time_s
    s0, s1 = t0.summary(), t1.summary()
    for key in ("time_s", "bound", "hbm_bytes", "lower_bound_s"):
        assert s1[key] == s0[key], key
    assert {k: v for k, v in t1.busy_s().items() if v} == {k: v for k, v in t0.busy_s().items() if v}
    # ... and the probes take no time: each starts and ends where its engine was.
    probes = [i for i, ins in enumerate(probed.instructions) if ins.mnemonic == "probe"]
    np.testing.assert_array_equal(t1.start_s[probes], t1.end_s[probes])


def test_the_first_engine_order_matters_so_the_probe_test_can_fail():
    """Sanity check of the test above: issuing queue 0's load first (what a probe at its head must
    not cause) changes the timing of this kernel."""
    plain = _busy_kernel(False)
    streams = plain.streams()
    q0 = next(e for e in streams if e.unit == "dma" and e.queue == 0)
    first = streams[q0][0]
    order = [first] + [i for i in range(len(plain.instructions)) if i != first]
    swapped = dataclasses.replace(plain, instructions=tuple(plain.instructions[i] for i in order))
    t0, t1 = run_timing(plain, TINY), run_timing(swapped, TINY)
    assert t0.time_s != t1.time_s or not np.array_equal(np.sort(t0.end_s), np.sort(t1.end_s))
