"""The compiled event loop (emu/timing_core.py) times every program exactly as the pure-Python loop
it replaced (tests/emu/timing_reference.py): bit-identical starts, ends, critical-path
predecessors and fixed costs (pipeline fills), and the same Deadlock, on every kernel the suite
registers (and copies of them broken on purpose), random programs with every kind of
instruction, the microbenchmarks, fused tiny-model steps, link collectives and the seeded bugs."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import microbench
from jalapeno_emu.emu.costs import StaticCosts
from jalapeno_emu.emu.timing import event_loop_args, run_timing
from jalapeno_emu.emu.timing_core import event_loop
from jalapeno_emu.errors import EmuError
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.isa.program import Program
from jalapeno_emu.kernels import get_kernel
from tests.emu.test_check_equivalence import _broken_copies, _case_id, _cases, _random_program
from tests.emu.test_seeded_bugs import CASES as SEEDED
from tests.emu.test_timing import random_program
from tests.emu.timing_reference import reference_run_timing

TINY = load_preset("tiny")
V1 = load_preset("jalapeno-v1")


def _outcome(fn, program: Program, spec) -> tuple:
    """("ok", the bits of every per-instruction result) or (error class, message, attributes)."""
    try:
        tl = fn(program, spec)
    except EmuError as e:
        return (type(e).__name__, str(e), sorted(vars(e).items()))
    return ("ok", tl.start_s.view(np.uint64).tolist(), tl.end_s.view(np.uint64).tolist(), tl.pred.tolist(),
            tl.fixed_s.view(np.uint64).tolist(), tl.time_s)


def assert_same_timing(program: Program, spec=TINY) -> str:
    """The compiled loop's outcome equals the reference's; returns its kind ("ok" or the error)."""
    want = _outcome(reference_run_timing, program, spec)
    got = _outcome(run_timing, program, spec)
    if got != want:  # say where, not just that
        assert got[0] == want[0], (got[0], want[0], got[1] if got[0] != "ok" else want[1])
        if got[0] == "ok":
            for name, g, w in zip(("start", "end", "pred", "fixed"), got[1:5], want[1:5], strict=True):
                bad = [i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b]
                assert not bad, f"{name} differs at {bad[:10]} ({program.name})"
        assert got == want
    return want[0]


def _deadlocked_copies(program: Program, rng: random.Random, n: int) -> list[Program]:
    """Up to ``n`` copies with one wait raised past every signal its semaphore will ever get."""
    total: dict[int, int] = {}
    for ins in program.instructions:
        if ins.mnemonic == "sem.signal":
            total[ins.arg("sem")] = total.get(ins.arg("sem"), 0) + ins.arg("count")
    waits = [i for i, ins in enumerate(program.instructions) if ins.mnemonic == "sem.wait"]
    out = []
    for i in rng.sample(waits, min(n, len(waits))):
        ins = program.instructions[i]
        value = total.get(ins.arg("sem"), 0) + 1
        args = tuple((k, value if k == "value" else v) for k, v in ins.args)
        out.append(dataclasses.replace(program, instructions=(
            *program.instructions[:i], dataclasses.replace(ins, args=args), *program.instructions[i + 1:])))
    return out


@pytest.mark.parametrize(("name", "shape"), _cases(), ids=_case_id)
def test_kernels_time_identically(name, shape):
    kdef = get_kernel(name)
    program = kdef.build(kdef.shape(shape), TINY).program
    assert assert_same_timing(program) == "ok"
    rng = random.Random(f"{name}{sorted(shape.items())}")
    for broken in _broken_copies(program, rng, 3):
        assert_same_timing(broken)
    kinds = {assert_same_timing(p) for p in _deadlocked_copies(program, rng, 3)}
    assert kinds <= {"Deadlock"}


@pytest.mark.parametrize("seed", range(60))
def test_random_programs_time_identically(seed):
    # Every kind of instruction on both cores: loads, stores, copies, gathers, matmuls, vector
    # ops, signals and waits on any engine, barriers.
    assert assert_same_timing(random_program(seed, TINY)) == "ok"


def test_dma_heavy_random_programs_time_identically():
    # Many small transfers on two queues per core, waits on every engine's signals: queue
    # turn-taking, pending signals on DMA queues, the pseudo-channel FIFOs.
    rng = random.Random(11)
    for n in range(80):
        assert_same_timing(_random_program(rng, skip=(0.0, 0.1)[n % 2], prefill=3 * (n % 3 == 0)))


@pytest.mark.parametrize("spec", [TINY, V1], ids=["tiny", "jalapeno-v1"])
def test_microbenchmarks_time_identically(spec):
    cores, shape = [0, 1], {"k": 256, "n": 256}
    for program in (
        microbench.pipeline_program(spec, 20, cores=cores, **shape),
        microbench.pipeline_program(spec, 9, cores=cores, nbuf=3, **shape),
        microbench.hbm_stream_program(spec, 8 << 20, cores=cores),
        microbench.hbm_stream_program(spec, 1 << 20, chunk_bytes=4096, cores=cores),
        microbench.streamed_matmul_program(spec, 32, 1024, 128, chunk_k=128, nbuf=3),
    ):
        assert assert_same_timing(program, spec) == "ok"


@pytest.mark.slow
def test_benchmark_programs_time_identically():
    # The programs bench_timing.py measures, smaller: every core of jalapeno-v1, 384 pseudo-channels.
    for program in (microbench.pipeline_program(V1, 6), microbench.hbm_stream_program(V1, 256 << 20)):
        assert assert_same_timing(program, V1) == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(("model", "preset", "phase"), [
    ("tiny-gpt-oss", "jalapeno-v1", "decode"), ("tiny-deepseek", "tiny", "decode"),
    ("tiny-deepseek", "tiny", "prefill")])
def test_fused_tiny_model_steps_time_identically(model, preset, phase):
    from jalapeno_emu.model import Step, load_model_config
    from jalapeno_emu.model.fused import build_fused

    spec = load_preset(preset)
    step = Step(phase, batch=2, context=40) if phase == "decode" else Step(phase, batch=1, seq=32)
    program = build_fused(load_model_config(model), step, spec).program
    assert assert_same_timing(program, spec) == "ok"


@pytest.mark.parametrize("name", sorted(SEEDED))
def test_seeded_bug_programs_time_identically(name):
    for fixed in (False, True):
        assert_same_timing(SEEDED[name](fixed=fixed).program)
    if name == "wait that can never be met":
        assert assert_same_timing(SEEDED[name]().program) == "Deadlock"


def test_link_collectives_time_identically():
    from jalapeno_emu.rack import emit_collective

    kb = KernelBuilder("layer", V1)
    x, buf = kb.hbm("x", (64, 1024), "f32"), kb.sram(0, "buf", (64, 1024), "f32")
    ready = kb.semaphore("ready")
    c0 = kb.core(0)
    c0.dma[0].load(buf, x)
    c0.dma[0].signal(ready)
    emitted = emit_collective(kb, "all_reduce", [4, 7, 9, 12], 4 << 20, rank=1, algorithm="ring", after=ready)
    emit_collective(kb, "all_to_all", 5, 256 * 1024, rank=2, algorithm="pairwise", name="a2a")
    c0.vpu.wait(emitted.done, 1)
    c0.vpu.exp(buf, buf)
    assert assert_same_timing(kb.build(), V1) == "ok"


def test_barriers_links_and_deadlocks_time_identically():
    kb = KernelBuilder("sync", TINY)
    x, y = kb.hbm("x", (16, 256), "f32"), kb.hbm("y", (16, 256), "f32")
    buf = kb.sram(0, "buf", (16, 256), "f32")
    c0, c1 = kb.core(0), kb.core(1)
    c0.dma[0].load(buf, x)
    for e in (c0.vpu, c1.mxu, c0.dma[1]):
        e.barrier(3, 3)
    c1.vpu.barrier(3, 3)  # arrives after the release: passes
    kb.link.recv(y, 0, 2)  # waits for the send below
    c0.dma[0].barrier(9, 1)
    prog = kb.build()
    assert assert_same_timing(prog) == "Deadlock"  # the recv waits for a send behind it
    kb.link.send(x, 0, 2)
    kb.link.send(x, 0, 2)
    kb.link.recv(y, 0, 2)
    c1.vpu.barrier(5, 2)  # only one arrival: a deadlock naming the barrier
    assert assert_same_timing(kb.build()) == "Deadlock"


def test_probes_time_identically():
    kb = KernelBuilder("probes", TINY)
    x = kb.hbm("x", (8, 64), "f32")
    buf = kb.sram(0, "buf", (8, 64), "f32")
    loaded = kb.semaphore("loaded")
    c0 = kb.core(0)
    if not hasattr(c0.vpu, "probe"):
        pytest.skip("the builder has no probe yet")
    c0.dma[1].probe(x, "first on its queue")
    c0.dma[0].load(buf, x)
    c0.dma[0].signal(loaded)
    c0.vpu.wait(loaded, 1)
    c0.vpu.probe(buf, "before")
    c0.vpu.exp(buf, buf)
    c0.vpu.probe(buf, "after")
    assert assert_same_timing(kb.build()) == "ok"


def test_the_uncompiled_loop_agrees_too():
    # The loop's own Python source (numba's py_func), run by the interpreter: the compiled code is
    # what that source means, so the coverage the tests above measure is honest.
    for program in (random_program(1, TINY), random_program(4, TINY),
                    microbench.pipeline_program(TINY, 3, k=256, n=256)):
        args = event_loop_args(StaticCosts(program, TINY), TINY)
        compiled = event_loop(*args)
        interpreted = event_loop.py_func(*args)
        for a, b in zip(compiled, interpreted, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        want = reference_run_timing(program, TINY)
        assert compiled[0].tobytes() == want.start_s.tobytes()
