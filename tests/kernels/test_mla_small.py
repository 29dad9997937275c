"""mla-decode / mla-prefill on small scratchpads (GPU presets): the HBM-phased tilings.

Functional checks force the small-scratchpad path on ``tiny`` by shrinking its scratchpad; the
real models' shapes on b200 are timing-only.
"""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.chip.load import apply_overrides
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.kernels import run_kernel

DEEPSEEK_TP8 = {"q_heads": 16, "kv_lora_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128}


def _tiny(scratchpad: str):
    return apply_overrides(load_preset("tiny"), [f"sram.scratchpad_bytes={scratchpad}"])


def test_decode_small_path_matches_reference_over_head_groups_and_batch_blocks():
    # 24 KiB (a plan within 95 % of it): two groups of 4 heads, GEMM jobs of 8 sequences (two
    # blocks for 9), padded context.
    r = run_kernel("mla-decode", {"batch": 9, "context": 40}, preset=_tiny("24KiB"), check=True)
    assert r.notes["path"] == "small-scratchpad"
    assert r.notes["head_group"] < 8 and r.notes["gemm_rows"] < 9 and r.notes["padded_tokens"] > 0
    assert r.check["passed"], r.check


def test_decode_small_path_one_group_several_tiles():
    r = run_kernel("mla-decode", {"batch": 3, "context": 100}, preset=_tiny("48KiB"), check=True)
    assert r.notes["path"] == "small-scratchpad" and r.notes["head_group"] == 8
    assert r.notes["kv_tile"] < 128  # more than one context tile: the online rescale runs
    assert r.check["passed"], r.check


def test_prefill_small_path_matches_reference_with_prior():
    r = run_kernel("mla-prefill", {"batch": 2, "seq": 64, "prior": 64, "q_heads": 2},
                   preset=_tiny("56KiB"), check=True)
    assert r.notes["path"] == "small-scratchpad" and r.notes["tile"] == 32 and r.notes["key_tiles"] == 4
    assert r.check["passed"], r.check


def test_v1_keeps_its_programs():
    # Pinned before the small-scratchpad path existed: the one-core-per-sequence v1 tiling still
    # times the same (16 more instructions than then: each head core signals when its output
    # columns are stored, what a fused program's next operator waits for; signals take no time;
    # 8 more since: each attention core sends its output rows to the head cores on all four
    # queues, one more signal each; the time is the same).
    r = run_kernel("mla-decode", {**DEEPSEEK_TP8, "batch": 8, "context": 1000, "kv_splits": 1},
                   preset="jalapeno-v1", safety_checks=False)
    assert "path" not in r.notes and r.notes["kv_splits"] == 1 and r.notes["kv_buffers"] == 2
    assert r.summary["instructions"] == 1272 + 16 + 8
    assert r.summary["time_s"] == pytest.approx(1.4809934307359305e-05, rel=1e-12)


def test_deepseek_tp8_decode_builds_on_b200_timing_only():
    r = run_kernel("mla-decode", {**DEEPSEEK_TP8, "batch": 8, "context": 1024}, preset="b200",
                   safety_checks=False)
    assert r.notes["path"] == "small-scratchpad" and r.notes["head_group"] == 16
    # The cache is read once per head group; the lower bound is HBM time for those bytes.
    assert r.summary["hbm_bytes"] >= r.notes["latent_cache_bytes"] + r.notes["weight_bytes"]
    assert r.summary["time_s"] >= r.summary["lower_bound_s"]


def test_deepseek_tp8_prefill_chunk_builds_on_b200_timing_only():
    r = run_kernel("mla-prefill", {**DEEPSEEK_TP8, "seq": 256, "prior": 256}, preset="b200",
                   safety_checks=False)
    assert r.notes["path"] == "small-scratchpad" and r.notes["tile"] >= 64
    assert r.summary["hbm_bytes"] >= r.notes["scratch_bytes"]  # K/V written and read back at least once


@pytest.mark.parametrize("kernel, shape", [
    ("mla-decode", {"batch": 2, "context": 64}),
    ("mla-prefill", {"batch": 1, "seq": 64}),
])
def test_too_small_scratchpad_is_refused_with_numbers(kernel, shape):
    with pytest.raises(InvalidArgumentError, match=r"cannot hold this shape.*\d,\d{3} B of scratchpad"):
        run_kernel(kernel, shape, preset=_tiny("14KiB"))
