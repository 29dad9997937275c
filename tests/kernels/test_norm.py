"""rmsnorm: functional result within its tolerance of the pure-JAX reference; timing sanity."""

import pytest

from jalapeno_emu.chip import apply_overrides, load_preset
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels import get_kernel, run_kernel


@pytest.mark.parametrize("shape", [{"tokens": 8, "hidden": 256}, {"tokens": 5, "hidden": 96},
                                   {"tokens": 67, "hidden": 64},
                                   # rows where XLA's sum order differs from the vector unit's
                                   {"tokens": 3, "hidden": 1024}])
def test_rmsnorm_matches_reference(shape):
    r = run_kernel("rmsnorm", shape, check=True)
    assert r.check["passed"], r.check
    assert r.summary["time_s"] >= r.summary["lower_bound_s"]


def test_rmsnorm_full_size_timing_only_is_hbm_or_latency_bound():
    r = run_kernel("rmsnorm", {"tokens": 4096, "hidden": 2880}, preset="jalapeno-v1")
    # 4 bytes in, 4 out per element; nothing on the matrix unit.
    assert r.summary["hbm_bytes"] >= 4096 * 2880 * 8
    assert r.summary["flops"] == 0 and r.summary["bound"] in ("hbm", "latency")


def test_impossible_shapes_are_refused_before_building():
    with pytest.raises(InvalidArgumentError, match="scratchpad"):
        run_kernel("rmsnorm", {"hidden": 1 << 16})
    with pytest.raises(InvalidArgumentError, match="hidden=1048576 is above its limit of 65,536"):
        run_kernel("rmsnorm", {"hidden": 1 << 20})
    with pytest.raises(InvalidArgumentError, match="eps"):
        run_kernel("rmsnorm", {"eps": -1.0})
    with pytest.raises(InvalidArgumentError, match="no shape key"):
        get_kernel("rmsnorm").shape(texts=["tokenz=3"])
    with pytest.raises(InvalidArgumentError, match=">= 1"):
        get_kernel("rmsnorm").shape(texts=["tokens=0"])


def test_rmsnorm_without_residual_matches_reference_and_moves_half_the_input():
    r = run_kernel("rmsnorm", {"tokens": 6, "hidden": 64, "residual": False}, check=True)
    assert r.check["passed"], r.check
    assert set(r.build.outputs) == {"y"}
    fused = run_kernel("rmsnorm", {"tokens": 4096, "hidden": 512}, preset="jalapeno-v1")
    plain = run_kernel("rmsnorm", {"tokens": 4096, "hidden": 512, "residual": False}, preset="jalapeno-v1")
    # fused: x, residual in; y, h out. plain: x in, y out (plus the weight and eps either way).
    assert plain.summary["hbm_bytes"] < 0.55 * fused.summary["hbm_bytes"]


def test_rmsnorm_single_buffered_when_two_rows_do_not_fit():
    # 6 KiB of scratchpad: two 256-wide rows with their f32 scratch (2 x 3 KiB) do not fit, one does.
    small = apply_overrides(load_preset("tiny"), ["sram.scratchpad_bytes=6KiB"])
    r = run_kernel("rmsnorm", {"tokens": 9, "hidden": 256}, preset=small, check=True)
    assert r.check["passed"], r.check
    assert r.build.notes["buffer_slots"] == 1
    plain = run_kernel("rmsnorm", {"tokens": 9, "hidden": 256, "residual": False}, preset=small, check=True)
    assert plain.check["passed"], plain.check
    # The real models' widest norm now builds on a GPU's 228 KiB shared memory.
    gpu = run_kernel("rmsnorm", {"tokens": 64, "hidden": 7168}, preset="b200")
    assert gpu.build.notes["buffer_slots"] == 1
    assert gpu.summary["hbm_bytes"] >= 64 * 7168 * 8
    # The double-buffered path is kept wherever it fits.
    narrow = run_kernel("rmsnorm", {"tokens": 64, "hidden": 2880}, preset="b200")
    assert narrow.build.notes["buffer_slots"] == 2
