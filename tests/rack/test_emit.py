"""emit_collective: one chip's link steps in a kernel, timed as collectives.py prices them."""

import numpy as np
import pytest

from jalapeno_emu import chip
from jalapeno_emu.emu import check_program, run_functional, run_timing
from jalapeno_emu.emu.timeline import CATEGORIES
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.rack import all_reduce, all_to_all, emit_collective

MIB = 2**20
LINK = CATEGORIES.index("link")


@pytest.fixture(scope="module")
def v1() -> chip.ChipSpec:
    return chip.load_preset("jalapeno-v1")


def _link_time_s(kb: KernelBuilder, spec: chip.ChipSpec) -> float:
    """Seconds from the kernel's start to the end of its last link instruction (launch excluded)."""
    tl = run_timing(kb.build(), spec)
    return float(tl.end_s[tl.category == LINK].max())


@pytest.mark.parametrize("rank", [0, 5])
def test_ring_all_reduce_times_as_the_alpha_beta_model(v1, rank):
    kb = KernelBuilder("ring", v1)
    emitted = emit_collective(kb, "all_reduce", 8, 8 * MIB, rank=rank, algorithm="ring")
    assert len(emitted.steps) == 14 and {s.port_bytes for s in emitted.steps} == {MIB}
    assert emitted.steps[0].send_to == (rank + 1) % 8 and emitted.steps[0].recv_from == (rank - 1) % 8
    assert _link_time_s(kb, v1) == pytest.approx(all_reduce(8, 8 * MIB, v1, "ring").time_s, rel=1e-9)
    assert emitted.timing == all_reduce(8, 8 * MIB, v1, "ring")


def test_uniform_all_to_all_times_as_the_alpha_beta_model(v1):
    kb = KernelBuilder("a2a", v1)
    emit_collective(kb, "all_to_all", 64, 256 * 1024, rank=17, algorithm="pairwise")
    assert _link_time_s(kb, v1) == pytest.approx(all_to_all(64, 256 * 1024, v1).time_s, rel=1e-9)


def test_skewed_all_to_all_the_hot_chip_sets_the_pace(v1):
    p = 8
    m = np.full((p, p), 64 * 1024)
    m[:, 2] = 1024 * 1024  # everyone sends chip 2 a lot (MoE dispatch to a popular expert)
    model = all_to_all(p, m, v1, "pairwise").time_s
    times = {}
    for rank in (2, 6):
        kb = KernelBuilder(f"a2a{rank}", v1)
        emit_collective(kb, "all_to_all", p, m, rank=rank, algorithm="pairwise")
        times[rank] = _link_time_s(kb, v1)
    assert times[2] == pytest.approx(model, rel=1e-9)  # the busiest chip's program is the collective
    assert times[6] < model  # a quiet chip finishes its part early


def test_folded_chips_of_a_non_power_of_two_only_send_and_receive_once_each(v1):
    kb = KernelBuilder("rd6", v1)
    folded = emit_collective(kb, "all_reduce", 6, MIB, rank=5, algorithm="recursive_doubling", name="a")
    assert [(s.send_to, s.recv_from) for s in folded.steps] == [(1, None), (None, 1)]
    partner = emit_collective(kb, "all_reduce", 6, MIB, rank=1, algorithm="recursive_doubling", name="b")
    assert [(s.send_to, s.recv_from) for s in partner.steps] == [(None, 5), (0, 0), (3, 3), (5, None)]
    assert partner.timing.time_s == pytest.approx(4 * v1.link.message_s(MIB))


def test_compute_hbm_and_links_share_one_timeline(v1):
    kb = KernelBuilder("layer", v1)
    x, buf = kb.hbm("x", (64, 1024), "f32"), kb.sram(0, "buf", (64, 1024), "f32")
    ready = kb.semaphore("ready")
    c0 = kb.core(0)
    c0.dma[0].load(buf, x)
    c0.dma[0].signal(ready)
    emitted = emit_collective(kb, "all_reduce", [4, 7, 9, 12], 4 * MIB, rank=1, algorithm="ring",
                              after=ready)
    c0.vpu.wait(emitted.done, 1)
    c0.vpu.exp(buf, buf)
    prog = kb.build()
    tl = run_timing(prog, v1)
    link = np.flatnonzero(tl.category == LINK)
    load, exp = 0, len(prog.instructions) - 1
    assert tl.start_s[link].min() >= tl.end_s[load]  # the collective waits for the data
    assert tl.start_s[exp] >= tl.end_s[link].max()  # the consumer waits for the collective
    assert tl.end_s[link].max() - tl.start_s[link].min() == pytest.approx(emitted.timing.time_s, rel=1e-6)
    peers = {ins.arg("peer") for ins in prog.instructions if ins.mnemonic == "link.send"}
    assert peers == {9}  # chip ids, not positions: position 1's right neighbour is chip 9


def test_emitted_programs_pass_the_checker_and_the_functional_pass():
    tiny = chip.load_preset("tiny")
    kb = KernelBuilder("small", tiny)
    m = np.array([[0, 100, 300], [50, 0, 20], [0, 700, 0]])
    emitted = emit_collective(kb, "all_to_all", 3, m, rank=1, algorithm="pairwise")
    prog = kb.build()
    check_program(prog, tiny)
    run_functional(prog)
    sends = [ins for ins in prog.instructions if ins.mnemonic == "link.send"]
    # step 1: out 20 B to chip 2, in 100 B from chip 0; step 2: out 50 B to chip 0, in 700 B from chip 2
    assert [(s.send_bytes, s.recv_bytes) for s in emitted.steps] == [(20, 100), (50, 700)]
    assert [ins.arg("src").cols for ins in sends] == [s.port_bytes for s in emitted.steps] == [100, 700]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"op": "all_reduce", "algorithm": "one_shot"}, r"posts every message at once"),
    ({"op": "all_to_all", "algorithm": "direct", "nbytes": 64}, r"posts every message at once"),
    ({"rank": 8}, r"rank=8 must be a chip position in \[0, 8\)"),
    ({"chips": 0}, r"chips=0 must be at least 1"),
    ({"nbytes": -4}, r"nbytes=-4 must be >= 0"),
    ({"op": "all_to_all", "algorithm": "pairwise", "nbytes": np.zeros((8, 3))}, r"found shape \[8, 3\]"),
])
def test_bad_input_raises_before_anything_is_emitted(v1, kwargs, message):
    kb = KernelBuilder("bad", v1)
    args = {"op": "all_reduce", "chips": 8, "nbytes": MIB, "rank": 0, "algorithm": "ring", **kwargs}
    op, chips, nbytes = args.pop("op"), args.pop("chips"), args.pop("nbytes")
    with pytest.raises(InvalidArgumentError, match=message):
        emit_collective(kb, op, chips, nbytes, **args)
    assert len(kb.build().instructions) == 0
