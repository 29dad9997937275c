"""Batched functional runs: the schedule of batches, and the same bytes as one call per instruction."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import functional
from jalapeno_emu.emu.batching import GRANULE, batch_schedule
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import get_kernel


def _span(lo, hi, key=0):
    """[lo, hi) in units of the schedule's granule (bytes closer than one are one location)."""
    return [(key, lo * GRANULE, hi * GRANULE)]


def test_independent_entries_of_a_group_share_a_call_and_a_read_after_write_splits_it():
    groups = ["a", "a", "a", "a"]
    reads = [_span(0, 4), _span(4, 8), _span(100, 104), _span(8, 12)]
    writes = [_span(50, 54), _span(54, 58), _span(8, 12), _span(60, 64)]  # entry 3 reads entry 2's write
    assert batch_schedule(groups, reads, writes) == [[0, 1, 2], [3]]


def test_a_later_write_over_what_the_group_read_or_wrote_stays_in_the_batch():
    groups = ["a", "a", "a"]
    reads = [_span(0, 4), _span(10, 14), _span(20, 24)]
    writes = [_span(30, 34), _span(0, 4), _span(30, 34)]  # WAR on 0..4, WAW on 30..34
    assert batch_schedule(groups, reads, writes) == [[0, 1, 2]]


def test_groups_that_share_a_byte_keep_their_order_and_others_commute():
    groups = ["a", "b", "a", "c"]
    reads = [_span(0, 4), _span(50, 54), _span(4, 8), _span(30, 34)]
    writes = [_span(30, 34), _span(60, 64), _span(40, 44), _span(70, 74)]  # c reads a's first write
    calls = batch_schedule(groups, reads, writes)
    assert calls == [[0, 2], [1], [3]]
    assert batch_schedule(groups, reads, writes, batch_max=1) == [[0], [2], [1], [3]]


def test_an_entry_without_a_group_runs_alone_between_the_others():
    groups = ["a", None, "a"]
    reads = [_span(0, 4), [], _span(4, 8)]
    writes = [_span(10, 14), [], _span(20, 24)]
    assert batch_schedule(groups, reads, writes) == [[0], [1], [2]]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 14), st.integers(1, 3),
                          st.integers(0, 14), st.integers(1, 3), st.booleans()),
                min_size=1, max_size=24))
def test_running_the_calls_gives_the_sequential_result(entries):
    """Each entry writes a function of what it reads (and of its number); run in order, and run as
    the calls (each call reads the memory first, then writes in order), memory ends the same."""
    groups = [None if alone else g for g, *_, alone in entries]
    reads = [_span(r, r + rn) for _, r, rn, *_ in entries]
    writes = [_span(w, w + wn) for _, _, _, w, wn, _ in entries]

    def cells(spans):  # the model's memory: one cell per granule
        (_, lo, hi), = spans
        return slice(lo // GRANULE, hi // GRANULE)

    def value(e, mem):
        return (int(mem[cells(reads[e])].sum()) * 31 + e + 1) % 251

    seq = np.zeros(20, np.int64)
    for e in range(len(entries)):
        seq[cells(writes[e])] = value(e, seq)
    mem = np.zeros(20, np.int64)
    calls = batch_schedule(groups, reads, writes, batch_max=3)
    assert sorted(e for c in calls for e in c) == list(range(len(entries)))
    for call in calls:
        assert len(call) <= 3 and len({groups[e] for e in call}) == 1
        vals = [value(e, mem) for e in call]
        for e, v in zip(call, vals, strict=True):
            mem[cells(writes[e])] = v
    assert np.array_equal(mem, seq) and (seq.any() or not entries)


def _per_core_program(cores: int):
    """Every core: load its rows of x, exp them, store them to y (one signature per step)."""
    kb = KernelBuilder("per_core_exp", chip="jalapeno-v1")
    x = kb.hbm("x", (cores * 4, 64), "f32")
    y = kb.hbm("y", (cores * 4, 64), "f32")
    for c in range(cores):
        core, v = kb.core(c), kb.sram(c, "v", (4, 64), "f32")
        loaded, done = kb.semaphore(f"l{c}"), kb.semaphore(f"d{c}")
        core.dma[0].load(v, x.sub(4 * c, 0, 4, 64))
        core.dma[0].signal(loaded)
        core.vpu.wait(loaded, 1)
        core.vpu.exp(v, v)
        core.vpu.signal(done)
        core.dma[1].wait(done, 1)
        core.dma[1].store(y.sub(4 * c, 0, 4, 64), v)
    return kb.build()


def _same_bytes_batched_or_not(prog, inputs):
    """The batched run, after checking that it leaves every buffer as one call per instruction does."""
    batched = run_functional(prog, inputs)
    single = run_functional(prog, inputs, batch=False)
    for name, buf in single.buffers.items():
        assert np.array_equal(batched.buffers[name], buf), name
    return batched


def test_one_step_on_every_core_is_one_call_with_the_same_bytes():
    prog = _per_core_program(16)
    data = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    batched = _same_bytes_batched_or_not(prog, {"x": data})
    np.testing.assert_allclose(batched.read("y"), np.exp(data), rtol=1e-6)
    calls = functional._batched_plan(prog, None)
    assert len(calls) == 3 and all(len(idx) == 16 for idx, *_ in calls)


def test_a_kernel_on_many_cores_gives_the_same_bytes_batched():
    spec = load_preset("jalapeno-v1")
    kd = get_kernel("moe")
    shape = kd.shape(dict(tokens=4, hidden=128, intermediate=128, experts=8, top_k=2))
    b = kd.build(shape, spec)
    inputs = b.make_inputs(0)
    batched = _same_bytes_batched_or_not(b.program, inputs)
    assert np.array_equal(batched.read("y").view(np.uint16), b.reference(inputs)["y"].view(np.uint16))
    _, plan = functional._plan(b.program, None)
    calls = functional._batched_plan(b.program, None)
    assert len(calls) < len(plan)
    kinds = {b.program.instructions[idx[0]].mnemonic for idx, *_ in calls if type(idx) is tuple}
    assert "mxu.matmul" in kinds and kinds & {"dma.load", "vec.acc_read"}  # mapped and vectorised


def _overlapping_stores_program(cores: int):
    """Every core loads its own rows of x and stores them over the same rows of y: one batch of
    stores whose writes overlap, so only their order decides what y holds."""
    kb = KernelBuilder("overlapping_stores", chip="jalapeno-v1")
    x = kb.hbm("x", (cores * 4, 64), "f32")
    y = kb.hbm("y", (4, 64), "f32")
    for c in range(cores):
        core, v = kb.core(c), kb.sram(c, "v", (4, 64), "f32")
        loaded = kb.semaphore(f"l{c}")
        core.dma[0].load(v, x.sub(4 * c, 0, 4, 64))
        core.dma[0].signal(loaded)
        core.dma[1].wait(loaded, 1)
        core.dma[1].store(y, v)
    return kb.build()


def test_a_batch_whose_writes_overlap_lands_them_in_order():
    prog = _overlapping_stores_program(8)
    data = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    batched = _same_bytes_batched_or_not(prog, {"x": data})
    order = [i for i in functional._planned(prog, None)[1] if prog.instructions[i[0]].mnemonic == "dma.store"]
    last_core = prog.instructions[order[-1][0]].engine.core
    assert np.array_equal(batched.read("y"), data[4 * last_core:4 * last_core + 4])
    calls = functional._batched_plan(prog, None)
    assert any(type(idx) is tuple and len(idx) == 8 and prog.instructions[idx[0]].mnemonic == "dma.store"
               for idx, *_ in calls)


def test_writes_are_disjoint_only_when_no_two_written_ranges_share_a_byte():
    disjoint = functional._writes_disjoint
    w = lambda key, lo, hi: (key, lo, hi, True)  # noqa: E731
    r = lambda key, lo, hi: (key, lo, hi, False)  # noqa: E731
    assert disjoint([[w("a", 0, 8)], [w("a", 8, 16)], [w("b", 0, 8)]])
    assert not disjoint([[w("a", 0, 8)], [w("a", 7, 16)]])
    assert not disjoint([[w("a", 0, 8), w("a", 4, 6)]])  # one entry's own outputs
    assert disjoint([[w("a", 0, 8), r("a", 8, 16)], [w("a", 8, 16), r("a", 0, 8)]])  # reads do not count
    assert not disjoint([[w("a", 16, 32)], [w("b", 0, 4)], [w("a", 0, 17)]])  # any order of entries
