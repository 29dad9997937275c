"""Progress reports from check_program and run_functional: monotonic, ending at the total, and
without effect on the results."""

import numpy as np
import pytest

from jalapeno_emu import mx
from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu import check_program, run_functional
from jalapeno_emu.emu.progress import report_interval, reporting_progress
from tests.emu.programs import build_gemm


@pytest.fixture(scope="module")
def gemm():
    m, n, k = 256, 128, 1024  # two cores, two K chunks: a few hundred instructions
    rng = np.random.default_rng(2)
    a = mx.quantize(rng.standard_normal((m, k)).astype(np.float32), axis=1)
    b = mx.quantize(rng.standard_normal((k, n)).astype(np.float32), axis=0)
    return build_gemm(m, n, k, double_buffer=True), {"A": a, "B": b}


def _assert_well_formed(calls):
    done = [d for d, _ in calls]
    totals = {t for _, t in calls}
    assert len(totals) == 1, totals
    (total,) = totals
    assert done[0] == 0 and done[-1] == total > 0
    assert done == sorted(done), done
    # coarse: about every 1%, never per instruction
    assert len(calls) <= total // report_interval(total) + 2


def test_functional_progress_is_monotonic_and_leaves_the_results_alone(gemm):
    prog, inputs = gemm
    calls = []
    with_progress = run_functional(prog, inputs, progress=lambda d, t: calls.append((d, t)))
    _assert_well_formed(calls)
    plain = run_functional(prog, inputs)
    assert with_progress.buffers.keys() == plain.buffers.keys()
    assert all(np.array_equal(with_progress.buffers[k], plain.buffers[k]) for k in plain.buffers)
    assert np.array_equal(with_progress.read("C"), np.asarray(mx.matmul(inputs["A"], inputs["B"])))


def test_check_progress_counts_every_instruction(gemm):
    prog, _ = gemm
    calls = []
    order = check_program(prog, load_preset("tiny"), progress=lambda d, t: calls.append((d, t)))
    _assert_well_formed(calls)
    assert calls[-1][1] == len(order) == len(prog.instructions)


def test_reporting_progress_reaches_passes_given_none_and_ends_with_the_block(gemm):
    prog, inputs = gemm
    seen = []
    with reporting_progress(lambda stage, d, t: seen.append((stage, d, t))):
        check_program(prog, load_preset("tiny"))
        run_functional(prog, inputs)
        explicit = []
        run_functional(prog, inputs, progress=lambda d, t: explicit.append(d))  # explicit wins
    assert explicit and [s for s, _, _ in seen].count("functional") == len(explicit)
    assert {s for s, _, _ in seen} == {"check", "functional"}
    for stage in ("check", "functional"):
        _assert_well_formed([(d, t) for s, d, t in seen if s == stage])
    n = len(seen)
    run_functional(prog, inputs)
    assert len(seen) == n
