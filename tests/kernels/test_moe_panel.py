"""moe on small scratchpads (the expert-slot program's panel form, kernels/moe_panel.py): bit-exact
against its reference at tiny shapes with the tiny preset's scratchpad shrunk so that the dense
program does not fit; unchanged plans where the dense program fits; real models' shapes on b200."""

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.kernels import get_kernel, run_kernel
from jalapeno_emu.kernels.moe import MoePlan, grouping_of, plan_moe
from jalapeno_emu.kernels.moe_gather_plan import GatherPlan
from jalapeno_emu.kernels.moe_panel_plan import PanelPlan, _sram_bytes
from jalapeno_emu.kernels.planning import DoesNotFit


def _tiny(scratchpad_bytes: int):
    return load_preset("tiny").replace(**{"sram.scratchpad_bytes": scratchpad_bytes})


CASES = {
    # gpt-oss: softmax router with bias, clamped SwiGLU, gate/up and down biases; panels of 32
    "gpt_oss_biases": (14 * 1024, dict(tokens=8, hidden=128, intermediate=96, experts=8, top_k=2,
                                       expert_bias=True)),
    # DeepSeek noaux_tc: score bias, 4 groups keep 2, a shared expert, scaling factor
    "deepseek_noaux_shared": (22 * 1024, dict(tokens=8, hidden=128, intermediate=64, experts=16, top_k=4,
                                              router="sigmoid_topk", activation="silu", score_bias=True,
                                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                              shared_experts=1)),
    # a dense FFN (DeepSeek's first layers) of two shared experts, with biases
    "dense_ffn": (16 * 1024, dict(tokens=6, hidden=128, intermediate=64, experts=0, top_k=1,
                                  shared_experts=2, activation="silu", expert_bias=True)),
    # one shared expert and no routing (DeepSeek-R1's dense layers): the down items write y
    "dense_ffn_direct": (16 * 1024, dict(tokens=6, hidden=128, intermediate=96, experts=0, top_k=1,
                                         shared_experts=1, activation="silu")),
    "dense_ffn_direct_bias": (16 * 1024, dict(tokens=5, hidden=128, intermediate=64, experts=0, top_k=1,
                                              shared_experts=1, activation="silu", expert_bias=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_panel_program_bit_exact(name):
    scratchpad, keys = CASES[name]
    spec = _tiny(scratchpad)
    shape = get_kernel("moe").shape(keys)
    p = plan_moe(shape, spec)
    assert isinstance(p, PanelPlan)
    assert _sram_bytes(p, shape) <= scratchpad
    assert len(p.down_blocks) > 1 or p.hk < p.h  # really paneled
    report = run_kernel("moe", keys, preset=spec, check=True)
    assert report.check["passed"]
    assert report.check["max_abs_error"] == 0.0
    assert report.notes["program"] == "panel"


def test_panel_hbm_bytes_follow_the_slots():
    """The routed weights read are D experts' (gathered by the routing), not all E."""
    spec = _tiny(14 * 1024)
    keys = dict(CASES["gpt_oss_biases"][1], distinct_experts=4, tokens=2)
    small = run_kernel("moe", keys, preset=spec, check=True)
    big = run_kernel("moe", dict(keys, distinct_experts=2), preset=spec)
    per_expert = small.notes["expert_bytes"]
    assert small.check["passed"]
    assert small.summary["hbm_bytes"] - big.summary["hbm_bytes"] >= 2 * per_expert


def test_dense_program_unchanged_where_it_fits():
    """tiny's own scratchpad keeps the dense program (same plan as before this path existed)."""
    spec = load_preset("tiny")
    for _, keys in CASES.values():
        shape = get_kernel("moe").shape(keys)
        assert isinstance(plan_moe(shape, spec), MoePlan)


def test_refuses_when_nothing_fits():
    spec = _tiny(4 * 1024)
    # The refusal names why both the slot program and its panel form do not fit.
    with pytest.raises(DoesNotFit, match=r"no program fits \(slots: shape key .*; panel: shape key"):
        run_kernel("moe", CASES["gpt_oss_biases"][1], preset=spec)


@pytest.mark.parametrize("preset", ["b200", "h200"])
def test_real_models_plan_on_gpus(preset):
    """gpt-oss-120b and DeepSeek-R1 / Kimi decode shapes plan on 228 KiB scratchpads."""
    spec = load_preset(preset)
    gpt_oss = dict(tokens=64, hidden=2880, intermediate=2880, experts=128, top_k=4, expert_bias=True,
                   routing="uniform")
    deepseek = dict(tokens=32, hidden=7168, intermediate=256, experts=32, top_k=8, router="sigmoid_topk",
                    activation="silu", score_bias=True, routed_scaling_factor=2.5, routing="uniform")
    dense = dict(tokens=64, hidden=7168, intermediate=2304, experts=0, top_k=1, shared_experts=1,
                 activation="silu")
    for keys in (gpt_oss, deepseek, dense):
        shape = get_kernel("moe").shape(keys)
        assert grouping_of(shape, spec) == "dense"
        p = plan_moe(shape, spec)
        assert isinstance(p, PanelPlan)
        assert _sram_bytes(p, shape) <= spec.sram.scratchpad_bytes


def test_real_shape_times_on_b200():
    """A DeepSeek-R1 routed launch (tp=8 ep=8 slice) builds and times on b200 (timing only)."""
    keys = dict(tokens=4, hidden=7168, intermediate=256, experts=32, top_k=8, router="sigmoid_topk",
                activation="silu", score_bias=True, routed_scaling_factor=2.5, distinct_experts=16)
    report = run_kernel("moe", keys, preset="b200", check=False, safety_checks=False)
    s = report.summary
    weights = 16 * report.notes["expert_bytes"]
    assert s["hbm_bytes"] >= weights
    assert s["time_s"] >= weights / 7.7e12


@pytest.mark.parametrize(("experts", "want"), [(0, PanelPlan), (256, GatherPlan)])
def test_auto_takes_panel_before_gather_for_a_dense_ffn(experts, want):
    """Past the slot program's accumulators (128 tokens of hidden 7168 on jalapeno-v1) a dense FFN
    runs as panel, not gather (46.6 against 163 us for DeepSeek-R1's); a routed MoE still gathers."""
    kdef = get_kernel("moe")
    shape = kdef.shape({"tokens": 128, "hidden": 7168, "intermediate": 18432 if not experts else 2048,
                        "experts": experts, "top_k": 8 if experts else 1, "shared_experts": 1,
                        "activation": "silu"})
    assert isinstance(plan_moe(shape, load_preset("jalapeno-v1")), want)


@pytest.mark.parametrize(("tokens", "want"), [(80, MoePlan), (96, GatherPlan)])
def test_a_slot_plan_starved_of_buffers_gives_way_to_gather(tokens, want):
    """Kimi K2.5's routed MoE on jalapeno-v1: at 80 tokens the slot program keeps three weight
    buffers (588 us, gather 800); at 96 only two (1,083 us), and auto takes gather (800 us)."""
    shape = get_kernel("moe").shape({"tokens": tokens, "hidden": 7168, "intermediate": 2048, "experts": 384,
                                     "top_k": 8, "shared_experts": 1, "activation": "silu",
                                     "router": "sigmoid_topk", "score_bias": True, "routing": "uniform"})
    spec = load_preset("jalapeno-v1")
    assert isinstance(plan_moe(shape, spec), want)
    assert grouping_of(shape, spec) == ("gather" if want is GatherPlan else "dense")


@pytest.mark.parametrize(("experts", "tokens"), [(384, 64), (256, 80)])
def test_the_slot_planner_takes_64_column_slices_at_64_to_80_tokens(experts, tokens):
    """Kimi K2.5 at 64 tokens and DeepSeek-R1 at 80 on jalapeno-v1: 64-column slices (123 items per
    core at 80 tokens) model the faster kernel (535.5 against 623.5 us, 455.6 against 531.8 us for
    96 columns, the choice while items beyond 64 per core were penalised)."""
    shape = get_kernel("moe").shape({"tokens": tokens, "hidden": 7168, "intermediate": 2048,
                                     "experts": experts, "top_k": 8, "shared_experts": 1,
                                     "activation": "silu", "router": "sigmoid_topk", "score_bias": True,
                                     "routing": "uniform"})
    p = plan_moe(shape, load_preset("jalapeno-v1"))
    assert isinstance(p, MoePlan) and {w for _, w in p.slices} == {64} and p.nbuf >= 3


def test_a_program_needing_tensors_an_operator_lacks_is_passed_over():
    """plan_moe(given=...) for a fused operator re-planned with the stand-alone plan's tensors: at
    96 tokens Kimi K2.5 gathers, but given only the slot program's tensors it keeps the slots."""
    from jalapeno_emu.kernels.moe import moe_tensors

    shape = get_kernel("moe").shape({"tokens": 96, "hidden": 7168, "intermediate": 2048, "experts": 384,
                                     "top_k": 8, "shared_experts": 1, "activation": "silu",
                                     "router": "sigmoid_topk", "score_bias": True, "routing": "uniform"})
    spec = load_preset("jalapeno-v1")
    slot_names = {ts.name for ts in moe_tensors(dict(shape, grouping="dense"), spec)}
    assert isinstance(plan_moe(shape, spec), GatherPlan)
    assert isinstance(plan_moe(shape, spec, given=slot_names), MoePlan)
    with pytest.raises(DoesNotFit, match=r"needs HBM tensors .* this operator was not given"):
        plan_moe(shape, spec, given={"x", "y"})


def test_panel_loops_compute_and_time_as_unrolled():
    """Whole rounds of K and I panels go out as hardware loops: bit-exact, and timed exactly as
    the same program unrolled (the engines' streams are the same instructions)."""
    from jalapeno_emu.emu import run_timing
    from jalapeno_emu.isa import unrolled_loops

    spec = _tiny(16 * 1024)
    keys = dict(tokens=4, hidden=1024, intermediate=64, experts=4, top_k=2, expert_bias=True)
    shape = get_kernel("moe").shape(keys)
    assert isinstance(plan_moe(shape, spec), PanelPlan)
    looped = get_kernel("moe").build(shape, spec).program
    with unrolled_loops():
        unrolled = get_kernel("moe").build(shape, spec).program
    assert looped.loops and not unrolled.loops
    assert len(looped.items) < unrolled.n_instructions == looped.n_instructions
    assert run_timing(looped, spec).time_s == run_timing(unrolled, spec).time_s
    report = run_kernel("moe", keys, preset=spec, check=True)
    assert report.check["passed"] and report.check["max_abs_error"] == 0.0


def test_dense_ffn_gather_keeps_more_down_buffers_bit_exact():
    """A dense FFN's gather program keeps more than two down-weight and output-row buffers in
    flight (routed experts keep two); the rotation over them stays bit-exact."""
    spec = load_preset("tiny")
    keys = dict(tokens=160, grouping="gather", experts=0, top_k=1, shared_experts=1, activation="silu")
    p = plan_moe(get_kernel("moe").shape(keys), spec)
    assert isinstance(p, GatherPlan) and p.nwd > 2
    routed = plan_moe(get_kernel("moe").shape(dict(keys, experts=8, top_k=2)), spec)
    assert isinstance(routed, GatherPlan) and routed.nwd == 2
    report = run_kernel("moe", keys, preset=spec, check=True)
    assert report.check["passed"] and report.check["max_abs_error"] == 0.0


def test_auto_with_a_slot_count_passes_gather_over_to_panel():
    """The rack's routed launch names its expert slots (distinct_experts) at a batch the kernel
    serves with slots. On a GPU scratchpad the slot program does not fit and gather has no slots:
    auto goes on to panel, as grouping_of says, where it used to raise and refuse the batch (the
    rack then ran gpt-oss-120b's experts on gb300 in 16-token pieces)."""
    from jalapeno_emu.errors import InvalidArgumentError

    spec = load_preset("gb300-nvl72")
    keys = dict(tokens=32, hidden=2880, intermediate=2880, experts=128, top_k=4, expert_bias=True,
                routing="uniform", act_fmt="fp8e4", capacity_factor=2.0, distinct_experts=82)
    shape = get_kernel("moe").shape(keys)
    assert grouping_of(shape, spec) == "dense"
    assert isinstance(plan_moe(shape, spec), PanelPlan)
    with pytest.raises(InvalidArgumentError, match="distinct_experts=82 applies to grouping=dense"):
        plan_moe(get_kernel("moe").shape(dict(keys, grouping="gather")), spec)
