"""attention-prefill and attention-decode on small scratchpads (GPU shared memory): prefill's lean
path that splits a KV group's query heads over several units, decode's fewer KV slots and query
ring of two, functionally at tiny shapes on a shrunk ``tiny``, and the real gpt-oss shapes
building on b200/h200 (timing only)."""

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.chip.load import apply_overrides
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels import get_kernel, run_kernel


def _tiny(scratchpad_kib: int):
    return apply_overrides(load_preset("tiny"), [f"sram.scratchpad_bytes={scratchpad_kib}KiB"])


@pytest.mark.parametrize("kib, shape, heads_per_unit", [
    # 4 heads per KV head: 32 tokens of all 4 do not fit; two units of 2 heads each (sinks of
    # heads 2 and 3 from the middle of the table), prior context, window mask
    (256, {"q_heads": 8, "kv_heads": 2, "seq": 64, "prior": 32, "window": 40}, 2),
    # one head per unit, spare capacity after the chunk, no sinks
    (176, {"q_heads": 8, "kv_heads": 2, "seq": 64, "prior": 64, "capacity": 160, "sinks": False}, 1),
    # the whole group per unit, but with the lean buffers (one query/output slot)
    (224, {}, 2),
])
def test_lean_prefill_matches_reference(kib, shape, heads_per_unit):
    r = run_kernel("attention-prefill", shape, preset=_tiny(kib), check=True)
    assert r.notes["lean"] and r.notes["heads_per_unit"] == heads_per_unit
    assert r.check["passed"], r.check
    for out in ("out", "k_cache", "v_cache"):
        assert r.check["outputs"][out]["passed"]
    assert r.summary["time_s"] >= r.summary["lower_bound_s"]


def test_lean_prefill_reads_each_kv_tile_once_per_head_slice():
    """Same shape, whole group per unit (256 KiB) against one head per unit (176 KiB): the same
    output bits (the rows' online softmaxes are independent), KV tiles walked twice as often."""
    kdef = get_kernel("attention-prefill")
    shape = kdef.shape({"seq": 96, "prior": 32, "window": 64})
    whole = kdef.build(shape, load_preset("tiny"))
    split = kdef.build(shape, _tiny(176))
    assert not whole.notes["lean"] and split.notes["heads_per_unit"] == 1
    assert split.notes["kv_tiles"] == 2 * whole.notes["kv_tiles"]
    ins = whole.make_inputs(3)
    a, b = run_functional(whole.program, ins), run_functional(split.program, ins)
    for name, (dt, shp) in whole.outputs.items():
        assert np.asarray(a.read(name, dt, shp)).tobytes() == np.asarray(b.read(name, dt, shp)).tobytes()


def test_prefill_too_small_scratchpad_is_refused_with_the_numbers():
    with pytest.raises(InvalidArgumentError, match=r"head_dim=64 .*needs [\d,]+ B of scratchpad.*"
                                                   r"tiny has 65,536 B"):
        run_kernel("attention-prefill", {}, preset=_tiny(64))


@pytest.mark.parametrize("preset", ["b200", "h200"])
def test_gpt_oss_tp8_prefill_chunk_builds_on_gpu_presets(preset):
    """gpt-oss-120b sliced tp=8 (8 query heads, 1 KV head), a 2048-token chunk after 8192
    cached tokens in its sliding layers: refused before the lean path, now built and timed."""
    shape = dict(batch=1, seq=2048, prior=8192, window=128, q_heads=8, kv_heads=1, head_dim=64)
    r = run_kernel("attention-prefill", shape, preset=preset, check=False, safety_checks=False)
    assert r.notes["lean"] and r.notes["heads_per_unit"] < 8
    # QK^T and PV of every query row over at least its 128-key window
    assert r.summary["flops"] >= 4 * 8 * 64 * 2048 * 128
    assert r.summary["time_s"] >= r.summary["lower_bound_s"]


@pytest.mark.parametrize("kib, shape, slots", [
    (40, {}, 3),  # three KV slots: slot reuse out of step with the two accumulator buffers
    # 8 units per core through a ring of 2 (planned with 95 % of the scratchpad: 3 slots of 32 keys)
    (40, {"batch": 8, "q_heads": 8, "kv_heads": 2}, 3),
    (48, {"page_size": 64, "kv_dtype": "fp8e4", "window": 100}, 2),  # MXFP8 pages, 2 slots
])
def test_lean_decode_matches_reference(kib, shape, slots):
    r = run_kernel("attention-decode", shape, preset=_tiny(kib), check=True)
    assert r.notes["kv_slots"] == slots
    assert r.check["passed"], r.check


def test_decode_too_small_scratchpad_is_refused_with_the_numbers():
    with pytest.raises(InvalidArgumentError, match=r"head_dim=64 .*32-token KV tile does not fit "
                                                   r"the 15,564 B of scratchpad tiny plans with \(2 slots"):
        run_kernel("attention-decode", {}, preset=_tiny(16))


def test_gpt_oss_decode_builds_on_a_64kib_scratchpad():
    """MI300X-sized LDS (64 KiB): gpt-oss tp=8 decode, two KV slots of 64 keys; it reads each KV
    byte once, as with six slots at 228 KiB, only slower (fewer bytes in flight per core)."""
    shape = dict(batch=148, context=2048, q_heads=8, kv_heads=1, head_dim=64)
    small = run_kernel("attention-decode", shape, check=False, safety_checks=False,
                       preset=apply_overrides(load_preset("b200"), ["sram.scratchpad_bytes=64KiB"]))
    full = run_kernel("attention-decode", shape, preset="b200", check=False, safety_checks=False)
    assert (small.notes["kv_slots"], full.notes["kv_slots"]) == (2, 6)
    kv_bytes = 148 * 2048 * 64 * 2 * 2
    assert kv_bytes <= small.summary["hbm_bytes"] == full.summary["hbm_bytes"] < 1.01 * kv_bytes
    assert full.summary["time_s"] < small.summary["time_s"] < 3 * full.summary["time_s"]
