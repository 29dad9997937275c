"""moe: functional result vs the pure-JAX reference (bit-exact in practice) and vs a float64 model
oracle; routing exact; HBM bytes follow the distinct experts hit; refusals; full-size timing."""

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.check import check_program
from jalapeno_emu.emu.functional import run_functional
from jalapeno_emu.errors import InvalidArgumentError, OutOfBounds
from jalapeno_emu.isa.builder import KernelBuilder
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.moe import (
    expected_distinct_experts,
    moe_reference,
    plan_moe,
)
from tests.kernels.moe_helpers import oracle, route_oracle

DEEPSEEK_TINY = {"router": "sigmoid_topk", "activation": "silu", "shared_experts": 1,
                 "routed_scaling_factor": 2.5}


@pytest.mark.parametrize("act_fmt, model_rel_err", [("fp8e4", 0.1), ("bf16", 0.01)])
@pytest.mark.parametrize("extra", [{}, DEEPSEEK_TINY], ids=["gpt-oss", "deepseek"])
def test_moe_matches_reference_and_model(extra, act_fmt, model_rel_err):
    r = run_kernel("moe", {**extra, "act_fmt": act_fmt}, check=True)
    assert r.check["passed"], r.check
    assert r.check["max_abs_error"] == 0.0  # same operations in the same order
    # Independent of the reference: the model's float64 definition, routing identical. MXFP8
    # activations (two E4M3 roundings per product) cost ~6 % here, BF16 ones ~0.2 %.
    b = r.build
    inputs = b.make_inputs(0)
    res = run_functional(b.program, inputs)
    got = res.read("y").astype(np.float64)
    want, ids = oracle(inputs, r.shape, load_preset("tiny"))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < model_rel_err
    hit, d = np.unique(ids), r.notes["distinct_experts"]
    padded = np.concatenate([hit, np.full(d - len(hit), hit[-1])])  # spare slots repeat the last
    assert np.array_equal(res.read("expert_ids", "i32", (d, 1))[:, 0], padded)


def _run_once(shape, edit=None):
    """Build (checked), make inputs (``edit`` may change them), run the functional pass once."""
    kdef, spec = get_kernel("moe"), load_preset("tiny")
    full = kdef.shape(shape)
    b = kdef.build(full, spec)
    check_program(b.program, spec)
    inputs = b.make_inputs(0)
    if edit:
        edit(inputs)
    return b, full, inputs, run_functional(b.program, inputs)


def _rel(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


DEEPSEEK_R1_TINY = {**DEEPSEEK_TINY, "n_group": 4, "topk_group": 2, "score_bias": True, "act_fmt": "bf16"}


def test_deepseek_noaux_routing_matches_hf_semantics():
    """Group-limited top-k on scores + e_score_correction_bias, gated by the unbiased scores."""
    def stronger_bias(inputs):  # N(0, 0.3): moves the selection, and would move the weights a lot
        inputs["score_bias"] = inputs["score_bias"] * np.float32(3)

    b, shape, inputs, res = _run_once(DEEPSEEK_R1_TINY, stronger_bias)
    got = res.read("y")
    assert np.array_equal(got.view(np.uint16), b.reference(inputs)["y"].view(np.uint16))
    spec = load_preset("tiny")
    want, ids = oracle(inputs, shape, spec)
    assert _rel(got, want) < 0.01  # BF16 activations; a wrong expert or weight costs far more
    p = plan_moe(shape, spec)
    hit = np.unique(ids)
    padded = np.concatenate([hit, np.full(p.d - len(hit), hit[-1])])
    assert np.array_equal(res.read("expert_ids", "i32", (p.d, 1))[:, 0], padded)
    # The inputs exercise both parts of noaux_tc: each changes some token's choice.
    x = np.asarray(inputs["x"], np.float64)
    for off in ({"groups": False}, {"score_bias": False}):
        other, _ = route_oracle(inputs, shape, p, x, **off)
        assert (np.sort(other, axis=1) != np.sort(ids, axis=1)).any(), off


# gpt-oss has no shared expert; one here also covers the weight-1 bias path.
BIAS_TINY = {"expert_bias": True, "shared_experts": 1, "act_fmt": "bf16"}


def test_gpt_oss_expert_biases_travel_with_the_experts():
    b, full, inputs, res = _run_once(BIAS_TINY)
    got = res.read("y")
    assert np.array_equal(got.view(np.uint16), b.reference(inputs)["y"].view(np.uint16))
    spec = load_preset("tiny")
    want, _ = oracle(inputs, full, spec)
    assert _rel(got, want) < 0.01
    assert _rel(got, oracle(inputs, full, spec, use_biases=False)[0]) > 0.05  # the biases matter
    h, i = full["hidden"], full["intermediate"]
    assert b.notes["expert_bytes"] == 51 * h * i // 32 + 2 * 2 * i + 2 * h  # + BF16 mlp1 and mlp2 bias


DENSE_TINY = {"experts": 0, "top_k": 1, "shared_experts": 2, "activation": "silu", "intermediate": 96}


def test_dense_ffn_mode_has_no_router_and_reads_only_the_shared_weights():
    r = run_kernel("moe", DENSE_TINY, check=True)
    assert r.check["passed"] and r.check["max_abs_error"] == 0.0, r.check
    b = r.build
    names = {a.name for a in b.program.allocations if a.space.value == "hbm"}
    assert names == {"x", "shared", "y"}  # no router, no routed table, no expert ids
    assert not any(ins.mnemonic in ("vec.topk", "vec.group", "dma.gather") for ins in b.program.instructions)
    inputs = b.make_inputs(0)
    got = run_functional(b.program, inputs).read("y").astype(np.float64)
    want, _ = oracle(inputs, r.shape, load_preset("tiny"))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1  # MXFP8 activations
    # HBM bytes: the shared experts once, x once per working core, y once.
    t, h = r.shape["tokens"], r.shape["hidden"]
    assert r.summary["hbm_bytes"] == 2 * r.notes["expert_bytes"] + 2 * t * h * (r.notes["cores"] + 1)


def _hot_inputs(build, hot):
    """Inputs whose routing sends every token to the experts in ``hot`` (router bias +30)."""
    inputs = build.make_inputs(1)
    bias = np.zeros_like(np.asarray(inputs["router_bias"], np.float32))
    bias[0, list(hot)] = 30.0
    inputs["router_bias"] = bias.astype(inputs["router_bias"].dtype)
    return inputs


def test_hbm_bytes_follow_distinct_experts_hit():
    shape = {"tokens": 4, "experts": 8, "top_k": 2}  # the default: 8 slots cover any routing
    spec = load_preset("tiny")
    kdef = get_kernel("moe")
    two = kdef.build(kdef.shape({**shape, "distinct_experts": 2}), spec)
    check_program(two.program, spec)
    # Every token picks experts 3 and 6: a 2-slot program serves it exactly, bit for bit.
    inputs = _hot_inputs(two, (3, 6))
    res = run_functional(two.program, inputs)
    want = moe_reference(inputs, plan_moe(kdef.shape({**shape, "distinct_experts": 2}), spec),
                         kdef.shape({**shape, "distinct_experts": 2}))
    assert np.array_equal(res.read("y").view(np.uint16), want["y"].view(np.uint16))
    assert res.read("expert_ids", "i32", (2, 1))[:, 0].tolist() == [3, 6]
    # Routing that spreads over more experts than the program has slots is refused, not wrong.
    with pytest.raises(OutOfBounds, match="distinct values"):
        run_functional(two.program, two.make_inputs(0))
    # HBM bytes: D x one expert, plus the same x / router / output traffic.
    r2 = run_kernel("moe", {**shape, "distinct_experts": 2})
    r8 = run_kernel("moe", {**shape, "distinct_experts": 8})
    per_expert = r2.notes["expert_bytes"]
    extra = r8.summary["hbm_bytes"] - r2.summary["hbm_bytes"]
    assert extra == 6 * per_expert + 6 * 4  # 6 more experts gathered (+ 6 more output ids)
    assert r2.summary["hbm_bytes"] < 0.4 * r8.summary["hbm_bytes"]


def test_distinct_expert_count_from_routing():
    assert expected_distinct_experts(128, 4, 1) == pytest.approx(4)
    assert expected_distinct_experts(128, 4, 64) == pytest.approx(128 * (1 - (1 - 4 / 128) ** 64))
    kdef, spec = get_kernel("moe"), load_preset("tiny")
    assert plan_moe(kdef.shape({"tokens": 4, "experts": 8, "top_k": 2}), spec).d == 8  # any: min(E, T*k)
    uni = plan_moe(kdef.shape({"tokens": 4, "experts": 8, "top_k": 2, "routing": "uniform"}), spec)
    assert uni.d == 6  # ceil(8 * (1 - 0.75^4)) = ceil(5.47)


def test_vec_group_semantics_and_padding():
    kb = KernelBuilder("group", chip="tiny")
    ids_h, w_h = kb.hbm("ids", (3, 2), "i32"), kb.hbm("w", (3, 2), "f32")
    out_ids, out_w = kb.hbm("out_ids", (5, 1), "i32"), kb.hbm("out_w", (5, 3), "f32")
    ids, w = kb.sram(0, "ids", (3, 2), "i32"), kb.sram(0, "w", (3, 2), "f32")
    g_ids, g_w = kb.sram(0, "g_ids", (5, 1), "i32"), kb.sram(0, "g_w", (5, 3), "f32")
    s1, s2 = kb.semaphore("in"), kb.semaphore("out")
    c = kb.core(0)
    c.dma[0].load(ids, ids_h)
    c.dma[0].load(w, w_h)
    c.dma[0].signal(s1)
    c.vpu.wait(s1, 1)
    c.vpu.group(g_ids, g_w, ids, w)
    c.vpu.signal(s2)
    c.dma[1].wait(s2, 1)
    c.dma[1].store(out_ids, g_ids)
    c.dma[1].store(out_w, g_w)
    prog = kb.build()
    check_program(prog, load_preset("tiny"))
    res = run_functional(prog, {"ids": np.array([[7, 2], [2, 9], [9, 7]], np.int32),
                                "w": np.array([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]], np.float32)})
    assert res.read("out_ids")[:, 0].tolist() == [2, 7, 9, 9, 9]  # padded with the largest
    np.testing.assert_array_equal(res.read("out_w"), [[0.25, 1.0, 0.0], [0.5, 0.0, 4.0],
                                                       [0.0, 2.0, 3.0], [0.0] * 3, [0.0] * 3])


@pytest.mark.parametrize("shape, match", [
    ({"top_k": 9}, "top_k=9"),
    ({"experts": 4, "top_k": 5}, "top_k=5"),
    ({"hidden": 48}, "hidden=48"),
    ({"intermediate": 80}, "intermediate=80"),
    ({"distinct_experts": 1}, "distinct_experts=1"),
    ({"distinct_experts": 9}, "distinct_experts=9"),
    ({"slice": 48}, "slice=48"),
    ({"tokens": 600, "grouping": "dense"}, "tokens=600"),  # the slot programs take <= 128 tokens
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"experts": 0}, "experts=0"),  # a dense FFN needs a shared expert
    ({"router": "sigmoid_topk", "n_group": 3}, "n_group=3"),  # must divide experts=8
    ({"router": "sigmoid_topk", "n_group": 2, "topk_group": 3}, "topk_group=3"),
    ({"router": "sigmoid_topk", "n_group": 4, "topk_group": 1, "top_k": 3}, "top_k=3"),
    ({"n_group": 2}, "n_group=2"),  # softmax_topk has no groups
    ({"score_bias": True}, "score_bias=True"),
    ({"experts": 0, "shared_experts": 1, "distinct_experts": 2}, "distinct_experts=2"),
])
def test_impossible_shapes_are_refused_before_building(shape, match):
    with pytest.raises(InvalidArgumentError, match=match):
        run_kernel("moe", shape)


def test_top_k_below_one_is_refused():
    with pytest.raises(InvalidArgumentError, match="top_k"):
        get_kernel("moe").shape(texts=["top_k=0"])


def test_full_size_gpt_oss_decode_timing_only():
    shape = {"tokens": 1, "hidden": 2880, "intermediate": 2880, "experts": 128, "top_k": 4}
    r = run_kernel("moe", shape, preset="jalapeno-v1")
    s, n = r.summary, r.notes
    assert n["distinct_experts"] == 4 and n["expert_bytes"] == int(2880 * 2880 * 3 * 4.25 / 8)
    # Only the 4 chosen experts are read: ~53 MB, not the 128 experts' 1.7 GB.
    assert n["routed_expert_bytes"] <= s["hbm_bytes"] < 1.05 * n["routed_expert_bytes"]
    assert s["time_s"] >= s["lower_bound_s"] and s["bound"] in ("latency", "hbm", "synchronisation")


def test_full_size_dense_ffn_timing_only():
    """DeepSeek-R1's dense layers (and Kimi's first): the FFN as moe with experts=0."""
    shape = {"tokens": 64, "hidden": 7168, "intermediate": 18432, "experts": 0, "top_k": 1,
             "shared_experts": 1, "activation": "silu"}
    r = run_kernel("moe", shape, preset="jalapeno-v1", check=False, safety_checks=False)
    s, weights = r.summary, 7168 * 18432 * 3 * 17 // 32  # 4.25 bits per weight
    assert r.notes["shared_expert_bytes"] == weights and r.notes["routed_expert_bytes"] == 0
    assert weights < s["hbm_bytes"] < 1.3 * weights  # + x once per core and y
    # MXFP8 x MXFP4 on 64 of a tile's 128 rows: the matrix unit needs about as long as HBM.
    assert max(s["memory_bound_s"], s["compute_bound_s"]) < s["time_s"] < 2.2 * s["lower_bound_s"]


def test_full_size_deepseek_r1_decode_timing_only():
    shape = {"tokens": 64, "hidden": 7168, "intermediate": 2048, "experts": 256, "top_k": 8,
             "shared_experts": 1, "router": "sigmoid_topk", "activation": "silu",
             "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "score_bias": True,
             "routing": "uniform"}
    r = run_kernel("moe", shape, preset="jalapeno-v1", check=False, safety_checks=False)
    s, n = r.summary, r.notes
    assert n["distinct_experts"] == 223  # ceil(256 * (1 - (1 - 8/256)^64))
    weights = n["routed_expert_bytes"] + n["shared_expert_bytes"]
    assert weights < s["hbm_bytes"] < 1.02 * weights
    assert s["bound"] in ("hbm", "compute") and s["time_s"] < 1.4 * s["lower_bound_s"]


# --- grouping=gather: tokens gathered per expert, outputs gathered back ---------------------------
# Two blocks of 80 tokens, capacity 60 per (expert, block): the overflow check runs; biases and a
# shared expert too.
GATHER_TINY = {**BIAS_TINY, "grouping": "gather", "tokens": 160, "capacity_factor": 3.0}


def test_gather_program_matches_reference_and_model():
    b, full, inputs, res = _run_once(GATHER_TINY)
    got = res.read("y")
    assert np.array_equal(got.view(np.uint16), b.reference(inputs)["y"].view(np.uint16))
    want, _ = oracle(inputs, full, load_preset("tiny"))
    assert _rel(got, want) < 0.01  # BF16 activations; a wrong row, weight or bias costs far more
    n = b.notes
    assert (n["block_tokens"], n["capacity"]) == (80, 60)
    assert n["routed_rows"] == full["experts"] * 2 * 60  # each expert: its two blocks' lists


def test_gather_capacity_overflow_is_an_error_not_a_drop():
    shape = {"grouping": "gather", "tokens": 8}  # capacity 4 of 8: some expert gets 5 of these tokens
    kdef, spec = get_kernel("moe"), load_preset("tiny")
    b = kdef.build(kdef.shape(shape), spec)
    assert b.notes["capacity"] == 4
    inputs = b.make_inputs(0)
    with pytest.raises(InvalidArgumentError, match="capacity=4"):
        b.reference(inputs)
    with pytest.raises(OutOfBounds, match="distinct values"):
        run_functional(b.program, inputs)


@pytest.mark.parametrize("shape, match", [
    ({"grouping": "gather", "distinct_experts": 4}, "distinct_experts=4"),
    ({"grouping": "gather", "capacity_factor": 0.0}, "capacity_factor"),
    ({"grouping": "gather", "tokens": 1009}, "tokens=1009"),  # no block size of 32..128 divides it
])
def test_gather_refusals(shape, match):
    with pytest.raises(InvalidArgumentError, match=match):
        run_kernel("moe", shape)


def test_full_size_deepseek_r1_prefill_timing_only():
    shape = {"tokens": 2048, "hidden": 7168, "intermediate": 2048, "experts": 256, "top_k": 8,
             "shared_experts": 1, "router": "sigmoid_topk", "activation": "silu",
             "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "score_bias": True}
    r = run_kernel("moe", shape, preset="jalapeno-v1", check=False, safety_checks=False)
    s, n = r.summary, r.notes
    assert n["grouping"] == "gather" and n["capacity"] == 8  # ceil(128 * 8 / 256 * 2) per 128-token block
    # Each expert computes its tokens' rows (capacity 2x the expected T*k/E), not all T of them:
    assert n["routed_rows"] == 256 * 16 * 8 == 2 * 2048 * 8
    weights = n["routed_expert_bytes"] + n["shared_expert_bytes"]
    assert weights < s["hbm_bytes"] < 1.7 * weights  # + the shared expert per row block, O rows, x
    assert s["bound"] in ("hbm", "compute") and s["time_s"] < 1.4 * s["lower_bound_s"]


def test_full_size_dense_ffn_prefill_timing_only():
    shape = {"tokens": 2048, "hidden": 7168, "intermediate": 18432, "experts": 0, "top_k": 1,
             "shared_experts": 1, "activation": "silu"}
    r = run_kernel("moe", shape, preset="jalapeno-v1", check=False, safety_checks=False)
    s = r.summary
    assert r.notes["grouping"] == "gather" and s["bound"] == "compute"
    assert s["time_s"] < 1.5 * s["lower_bound_s"]


def test_a_split_router_adds_its_k_blocks_in_block_order():
    """router_split=2 on tiny: H = 128 in blocks [0, 64) and [64, 128), each a producer's piece,
    added in block order. The router is built so that order decides the top-1 expert: expert 0's
    logit is 2^24 (block 0) + 1 (row 64) + 1 (row 96), expert 1's 2^24 + 2 (block 0). In one chain
    ((2^24 + 1) + 1) rounds to 2^24 twice and expert 1 wins; split, 2^24 + (1 + 1) ties expert 1
    and the lower index, expert 0, wins."""
    import ml_dtypes

    from jalapeno_emu.kernels.moe import router_panels

    shape = {"tokens": 2, "hidden": 128, "experts": 8, "top_k": 1, "router_split": 2}
    spec = load_preset("tiny")
    p = plan_moe(get_kernel("moe").shape(shape), spec)
    assert p.router_k == ((0, 64), (64, 128)) and p.router_producers == 2

    def tie_on_order(inputs):
        x = np.asarray(inputs["x"], np.float32)
        x[:, :128] = 0.0
        x[:, 0], x[:, 1], x[:, 64], x[:, 96] = 4096.0, 1.0, 1.0, 1.0
        inputs["x"] = x.astype(ml_dtypes.bfloat16)
        wr = np.zeros((128, 8), np.float32)
        wr[0, 0], wr[64, 0], wr[96, 0] = 4096.0, 1.0, 1.0
        wr[0, 1], wr[1, 1] = 4096.0, 2.0
        inputs["router"] = router_panels(wr.astype(ml_dtypes.bfloat16), p)
        inputs["router_bias"] = np.zeros((1, 8), ml_dtypes.bfloat16)

    b, _, inputs, res = _run_once(shape, tie_on_order)
    assert res.read("expert_ids", "i32", (p.d, 1))[:, 0].tolist() == [0] * p.d
    assert np.array_equal(res.read("y").view(np.uint16), b.reference(inputs)["y"].view(np.uint16))
    one_chain = get_kernel("moe").build(get_kernel("moe").shape({**shape, "router_split": 1}), spec)
    assert run_functional(one_chain.program, inputs).read("expert_ids", "i32", (p.d, 1))[:, 0].tolist() \
        == [1] * p.d


def test_the_automatic_router_split_cuts_the_chain_of_a_long_contraction():
    """gpt-oss-120b at batch 1 on jalapeno-v1: one 128-column panel, H = 2880 cut into blocks of
    at least an array fill (256 cycles, 8 BF16 steps), at most 16 pieces; a tiny H is not split."""
    spec = load_preset("jalapeno-v1")
    kdef = get_kernel("moe")
    big = plan_moe(kdef.shape({"tokens": 1, "hidden": 2880, "intermediate": 2880, "experts": 128,
                               "top_k": 4, "routing": "uniform"}), spec)
    assert big.router_parts == 1 and big.router_cols == 128
    assert 2 <= big.router_split <= 16
    assert all((k1 - k0) // 32 * 32 >= spec.matrix.pipeline_depth_cycles for k0, k1 in big.router_k)
    assert big.router_k[0][0] == 0 and big.router_k[-1][1] == 2880
    small = plan_moe(kdef.shape({"tokens": 1, "hidden": 128, "experts": 128, "top_k": 4}), spec)
    assert small.router_split == 1
    with pytest.raises(InvalidArgumentError, match="router_split=99"):
        plan_moe(kdef.shape({"tokens": 1, "hidden": 2880, "experts": 128, "top_k": 4, "router_split": 99}),
                 spec)


def test_a_decode_batch_reduces_y_on_fewer_cores_than_it_has():
    """Dense arrangement: at batch 1 on jalapeno-v1 y is reduced by 32 cores (each consumer pulls
    32 pieces, 8 per queue, leaving room for other operators' transfers), at batch 64 with every
    token in every slot by all 64 (each reducer's pull bytes then dominate); functionally exact
    with fewer reducers than cores."""
    spec = load_preset("jalapeno-v1")
    kdef = get_kernel("moe")
    gpt = {"hidden": 2880, "intermediate": 2880, "experts": 128, "top_k": 4}
    b1 = plan_moe(kdef.shape({**gpt, "tokens": 1, "routing": "uniform"}), spec)
    widths = [w for _, w in b1.red]
    assert not b1.routed and sum(w > 0 for w in widths) == 32 and sum(widths) == 2880
    b64 = plan_moe(kdef.shape({**gpt, "tokens": 64, "routing": "any", "distinct_experts": 4}), spec)
    assert not b64.routed and sum(w > 0 for _, w in b64.red) == 64
    # tiny with one queue of 2 in flight: room for one piece, so one core reduces all of y
    narrow = load_preset("tiny").replace(**{"dma.queues_per_core": 1, "dma.max_outstanding_per_queue": 2})
    shape = kdef.shape({"tokens": 2})
    p = plan_moe(shape, narrow)
    assert [w for _, w in p.red] == [64, 0]
    b = kdef.build(shape, narrow)
    check_program(b.program, narrow)
    inputs = b.make_inputs(0)
    got = run_functional(b.program, inputs).read("y")
    assert np.array_equal(got.view(np.uint16), b.reference(inputs)["y"].view(np.uint16))


def test_every_core_gathers_its_first_routed_chunk_before_anyone_gathers_a_second():
    """DeepSeek-R1's MoE at batch 1 on jalapeno-v1: a chunk is gathered in two pieces (gate|up,
    then down and biases), and each core's second piece waits for every core's routing
    (``routed_all``), so every first gate|up segment reaches the HBM channels first; without the
    wave a core that routes late finds its first segment behind the others' first chunks."""
    from jalapeno_emu.kernels.moe_pack import gu_bytes

    spec = load_preset("jalapeno-v1")
    kdef = get_kernel("moe")
    shape = kdef.shape({"tokens": 1, "hidden": 7168, "intermediate": 2048, "experts": 256, "top_k": 8,
                        "shared_experts": 1, "router": "sigmoid_topk", "activation": "silu", "n_group": 8,
                        "topk_group": 4, "score_bias": True, "routed_scaling_factor": 2.5,
                        "routing": "uniform"})
    p = plan_moe(shape, spec)
    prog = kdef.build(shape, spec).program
    wave = next(i for i, name in prog.semaphores if name == "routed_all")
    checked = 0
    for c in range(p.cores):
        stream = [ins for ins in prog.instructions if ins.engine.core == c and ins.engine.unit == "dma"
                  and ins.engine.queue == 0 and ins.mnemonic in ("dma.gather", "sem.wait")]
        gathers = [k for k, ins in enumerate(stream) if ins.mnemonic == "dma.gather"]
        waits = [k for k, ins in enumerate(stream)
                 if ins.mnemonic == "sem.wait" and dict(ins.args)["sem"] == wave]
        if len(gathers) >= 2:
            assert len(waits) == 1 and gathers[0] < waits[0] < gathers[1]
            assert dict(stream[waits[0]].args)["value"] == p.cores
            # the first piece is the gate|up segment alone: what the first matmul reads
            assert dict(stream[gathers[0]].args)["dst"].cols == gu_bytes(p.h, p.slice_max)
            checked += 1
    assert checked >= p.cores // 2
