"""The checker is sound: random programs it accepts give the same bytes under every legal order.

Programs are generated with every producer/consumer pair synchronised by a fresh semaphore; a
fraction of those synchronisations is then dropped on purpose. The checker must flag some of the
broken programs, and every program it accepts must produce identical memory under several
seeded interleavings of its engines.
"""

import random

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import Race, UninitializedRead
from jalapeno_emu.isa.builder import KernelBuilder

TINY = load_preset("tiny")
ROWS, COLS = 4, 32


def random_program(seed: int, drop_sync: float):
    """A random 2-core program over 3 HBM tensors and 3 SRAM buffers per core."""
    rng = random.Random(seed)
    kb = KernelBuilder(f"random{seed}", chip="tiny")
    hbm = [kb.hbm(f"t{i}", (ROWS, COLS), "f32") for i in range(3)]
    bufs = {(c, i): kb.sram(c, f"b{i}", (ROWS, COLS), "f32") for c in range(2) for i in range(3)}
    engines = {}
    for c in range(2):
        core = kb.core(c)
        engines[(c, "dma0")], engines[(c, "dma1")], engines[(c, "vpu")] = core.dma[0], core.dma[1], core.vpu
    # Per buffer: the last writer and the readers since, as (engine key, needs a sync).
    last_write: dict = {}
    readers: dict = {}
    written = set()
    n_sem = 0

    def order_after(consumer, producers):
        nonlocal n_sem
        for prod in producers:
            if prod == consumer and prod[1] == "vpu":
                continue  # the vector unit finishes in order: no sync needed
            if rng.random() < drop_sync:
                continue
            sem = kb.semaphore(f"s{n_sem}")
            n_sem += 1
            engines[prod].signal(sem)
            engines[consumer].wait(sem, 1)

    for _ in range(rng.randint(6, 14)):
        c = rng.randrange(2)
        kind = rng.choice(["load", "load", "vec", "vec", "store", "copy"])
        if kind == "load":
            eng, dst, src = (c, rng.choice(["dma0", "dma1"])), bufs[(c, rng.randrange(3))], rng.choice(hbm)
            reads, writes = [("hbm", src.offset)], ("sram", c, dst.offset)
        elif kind == "store":
            cands = [k for k in bufs if k[0] == c and ("sram", c, bufs[k].offset) in written]
            if not cands:
                continue
            eng, src, dst = (c, rng.choice(["dma0", "dma1"])), bufs[rng.choice(cands)], rng.choice(hbm)
            reads, writes = [("sram", c, src.offset)], ("hbm", dst.offset)
        elif kind == "copy":
            cands = [k for k in bufs if ("sram", k[0], bufs[k].offset) in written]
            if not cands:
                continue
            src_k = rng.choice(cands)
            dst_k = (1 - src_k[0], rng.randrange(3))
            eng, src, dst = (src_k[0], "dma0"), bufs[src_k], bufs[dst_k]
            reads, writes = [("sram", src_k[0], src.offset)], ("sram", dst_k[0], dst.offset)
        else:
            cands = [k for k in bufs if k[0] == c and ("sram", c, bufs[k].offset) in written]
            if not cands:
                continue
            eng = (c, "vpu")
            a, b = bufs[rng.choice(cands)], bufs[rng.choice(cands)]
            dst = bufs[(c, rng.randrange(3))]
            reads, writes = [("sram", c, a.offset), ("sram", c, b.offset)], ("sram", c, dst.offset)
        producers = {last_write[r] for r in reads if r in last_write}
        producers |= {last_write[writes]} if writes in last_write else set()
        producers |= readers.get(writes, set())
        order_after(eng, producers)
        if kind == "load":
            engines[eng].load(dst, src)
        elif kind == "store":
            engines[eng].store(dst, src)
        elif kind == "copy":
            engines[eng].copy(dst, src)
        else:
            engines[eng].issue("vec.binary", rng.choice(["add", "mul", "max"]), dst, a, b)
        for r in reads:
            readers.setdefault(r, set()).add(eng)
        last_write[writes] = eng
        readers[writes] = set()
        written.add(writes)
    return kb.build()


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal((ROWS, COLS)).astype(np.float32) for i in range(3)}


def _memory(result):
    return {k: v.tobytes() for k, v in result.buffers.items()}


@pytest.mark.parametrize("seed", range(12))
def test_synchronised_random_programs_are_accepted_and_schedule_independent(seed):
    prog = random_program(seed, drop_sync=0.0)
    check_program(prog, TINY)
    base = _memory(run_functional(prog, _inputs(seed)))
    for sched in (1, 2, 3):
        assert _memory(run_functional(prog, _inputs(seed), schedule_seed=sched)) == base


def test_checker_catches_dropped_synchronisation_and_accepts_only_safe_programs():
    caught = accepted = 0
    for seed in range(40):
        prog = random_program(100 + seed, drop_sync=0.5)
        try:
            check_program(prog, TINY)
        except (Race, UninitializedRead):
            caught += 1
            continue
        accepted += 1
        base = _memory(run_functional(prog, _inputs(seed)))
        for sched in (1, 2):
            assert _memory(run_functional(prog, _inputs(seed), schedule_seed=sched)) == base, seed
    assert caught >= 5 and accepted >= 3, (caught, accepted)
