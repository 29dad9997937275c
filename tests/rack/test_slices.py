"""Per-chip slices: the plan's kernels with sliced shapes, work conserved, MoE traffic matrices."""

import numpy as np
import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.model import Step, layer_launches, load_model_config
from jalapeno_emu.rack.launch_timer import LaunchTimer
from jalapeno_emu.rack.mapping import Mapping
from jalapeno_emu.rack.routing import ExpertLoad, parse_routing
from jalapeno_emu.rack.slices import (
    DENSE_PART_CONTEXT,
    chip_config,
    chip_layer_launches,
    layer_collectives,
    moe_byte_matrices,
    routed_moe_launch,
    token_launches,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model_config("tiny-gpt-oss")  # 4 query heads, 2 KV heads of 32, 8 experts top-2


@pytest.fixture(scope="module")
def timer():
    return LaunchTimer("jalapeno-v1")


def test_chip_config_splits_heads_and_widths():
    gpt = load_model_config("gpt-oss-120b")
    c = chip_config(gpt, Mapping(tp=16, ep=16))
    assert (c.q_heads, c.kv_heads, c.experts, c.moe_intermediate) == (4, 1, 8, 2880)
    c = chip_config(gpt, Mapping(tp=4))  # ep=1: every expert's 2880 columns over 4 chips
    assert (c.q_heads, c.kv_heads, c.experts, c.moe_intermediate, c.vocab) == (16, 2, 128, 736, 50272)
    ds = chip_config(load_model_config("deepseek-r1"), Mapping(tp=8, ep=8))
    assert (ds.q_heads, ds.kv_heads, ds.dense_intermediate, ds.experts, ds.n_group) == (16, 16, 2304, 32, 1)


def test_one_chip_runs_the_plans_launches(tiny):
    step = Step("decode", batch=4, context=100)
    load = ExpertLoad(tiny.experts, tiny.top_k, 1)
    plan = layer_launches(tiny, 1, step)
    chip = chip_layer_launches(tiny, Mapping(), 1, step, load)
    assert [(la.label, la.kernel) for la in chip] == [(la.label, la.kernel) for la in plan]
    assert [la for la in chip if la.label != "moe"] == [la for la in plan if la.label != "moe"]
    moe = next(la for la in chip if la.label == "moe").shape_dict
    assert (
        moe["tokens"] == 4
        and moe["experts"] == 8
        and moe["distinct_experts"] == round(float(load.distinct(4)))
    )


def test_tensor_parallel_gemms_conserve_flops_and_weight_bytes(tiny, timer):
    t = 16
    whole = {la.label: timer.time(la) for la in token_launches(tiny, Mapping(), 0, t) if la.kernel == "gemm"}
    half = {
        la.label: timer.time(la) for la in token_launches(tiny, Mapping(tp=2), 0, t) if la.kernel == "gemm"
    }
    assert set(whole) == {"qkv_proj", "o_proj"}
    for label in whole:
        assert 2 * half[label].flops == pytest.approx(whole[label].flops, rel=1e-9), label
    # qkv: weights, bias and output split in two; the only extra bytes are the input rows read by
    # both chips (at most one more read of x: the kernel may read x per column panel anyway)
    x_bytes = t * tiny.hidden * 2
    extra = 2 * half["qkv_proj"].hbm_bytes - whole["qkv_proj"].hbm_bytes
    assert 0 <= extra <= x_bytes


def test_expert_parallel_slices_conserve_expert_work(tiny, timer):
    """ep=2 chips each take 4 experts: the distinct experts (weights read) over both groups equal
    one die's, and the (token, expert) pairs routed add up to tokens x top_k."""
    stage_tokens = 16
    load = ExpertLoad(tiny.experts, tiny.top_k, 2)
    groups = [float(load.distinct(stage_tokens, g)) for g in range(2)]
    whole = float(ExpertLoad(tiny.experts, tiny.top_k, 1).distinct(stage_tokens))
    assert sum(groups) == pytest.approx(whole)
    pairs = sum(float(load.received(stage_tokens, g)) * load.picks_per_token(g) for g in range(2))
    assert pairs == pytest.approx(stage_tokens * tiny.top_k)
    one = timer.time(
        routed_moe_launch(
            tiny, Mapping(tp=1, dp=2, ep=2), load.received(16), groups[0], load.picks_per_token()
        )
    )
    die = timer.time(routed_moe_launch(tiny, Mapping(), 16, whole, tiny.top_k))
    assert one.hbm_bytes < die.hbm_bytes  # half the experts' weights on each chip


def test_moe_byte_matrices_dp1_is_a_reduce_scatter_and_dp_groups_dispatch(tiny):
    load = ExpertLoad(tiny.experts, tiny.top_k, 1)
    dispatch, combine = moe_byte_matrices(tiny, Mapping(tp=4), load, 64)
    row = 16 * tiny.hidden * 2  # 64 tokens, 16 homed per chip, BF16
    assert not dispatch.any()  # the DP group already holds every token
    assert np.all(combine.sum(axis=1) == 3 * row) and np.all(np.diag(combine) == 0)
    ep = ExpertLoad(tiny.experts, tiny.top_k, 4)
    dispatch, combine = moe_byte_matrices(tiny, Mapping(tp=1, dp=4, ep=4), ep, 64)
    assert np.all(dispatch[~np.eye(4, dtype=bool)] == round(16 * ep.hit[0] * tiny.hidden * 2))
    assert np.array_equal(dispatch, combine.T)


def test_skewed_routing_loads_the_busiest_chip_and_its_links(tiny):
    v1 = load_preset("jalapeno-v1")
    m = Mapping(tp=1, dp=4, ep=4)
    uniform = ExpertLoad(tiny.experts, tiny.top_k, 4)
    skewed = ExpertLoad(tiny.experts, tiny.top_k, 4, parse_routing("zipf:1.5"))
    assert float(skewed.received(256)) > float(uniform.received(256))
    a = layer_collectives(tiny, v1, m, 0, 64, 256, uniform)
    b = layer_collectives(tiny, v1, m, 0, 64, 256, skewed)
    assert b["moe_combine"].time_s > a["moe_combine"].time_s
    assert b["moe_dispatch"].busiest_chip_bytes > a["moe_dispatch"].busiest_chip_bytes


@pytest.mark.parametrize("preset", ["tiny", "jalapeno-v1"])
def test_a_token_part_feeds_the_shared_expert_the_chips_own_tokens(preset):
    """Under tp, a MoE layer's shared expert runs on the chip's t/tp home tokens while its norm
    produces all t: the fused part must hand it t/tp rows. It handed it all t, and the program
    was illegal (every DeepSeek-R1 sweep on jalapeno-v1 stopped there)."""
    cfg = load_model_config("tiny-deepseek")
    layer = next(i for i in range(cfg.layers) if cfg.is_moe(i))
    mapping = Mapping(tp=2)
    launches = token_launches(cfg, mapping, layer, 2)
    tokens = {la.label: la.shape_dict.get("tokens") for la in launches}
    assert tokens["ffn_norm"] == 2 and tokens["shared_ffn"] == 1
    fig = LaunchTimer(preset).time_part(chip_config(cfg, mapping), layer,
                                        Step("decode", batch=2, context=DENSE_PART_CONTEXT), launches)
    assert fig.time_s > 0 and fig.flops > 0


def test_a_fused_dense_ffn_after_its_norm_plans_as_stand_alone():
    """Timing only, full size. DeepSeek-R1's dense FFN on a tp=4 chip, 1024 tokens, fused after
    its norm: the norm's kept outputs used to split the scratchpad so that the gather program was
    re-planned into more intermediate ranges than its shared-partial table holds (it wrote past
    the table, then refused and was timed as launches). Kept outputs now sit at the top of the
    scratchpad and an operator is placed by first fit before any re-plan, so the part fuses with
    the stand-alone plan (``test_moe_emit``'s table guard still covers a re-plan that outgrows
    its tables)."""
    cfg = load_model_config("deepseek-r1")
    mapping = Mapping(tp=4)
    launches = token_launches(cfg, mapping, 0, 1024)
    timer = LaunchTimer("jalapeno-v1")
    step = Step("decode", batch=1024, context=DENSE_PART_CONTEXT)
    part = timer.time_part(chip_config(cfg, mapping), 0, step, launches)
    alone = [timer.time(la) for la in launches]
    # one program: no launch cost, the same work, and no slower than the launches back to back
    assert part.flops == pytest.approx(sum(a.flops for a in alone), rel=1e-9)
    assert part.pieces == 1 and 0 < part.time_s < sum(a.time_s for a in alone)


def _replanned_part(monkeypatch):
    """tiny-deepseek's MoE-layer token part at 2 tokens with its first operator marked re-planned
    (``fused.build_part`` patched): (chip config, layer, step, launches, list of builds so far)."""
    import jalapeno_emu.model.fused as fused

    cfg = load_model_config("tiny-deepseek")
    layer = next(i for i in range(cfg.layers) if cfg.is_moe(i))
    mapping = Mapping(tp=2)
    launches = token_launches(cfg, mapping, layer, 2)
    step = Step("decode", batch=2, context=DENSE_PART_CONTEXT)
    real = fused.build_part
    builds = []

    def with_a_replan(*args, **kwargs):
        fb = real(*args, **kwargs)
        fb.composer.ops[0].replanned = True
        builds.append(1)
        return fb

    monkeypatch.setattr(fused, "build_part", with_a_replan)
    return chip_config(cfg, mapping), layer, step, launches, builds


def test_a_fused_part_slower_than_its_launches_with_replanned_operators_is_refused(monkeypatch):
    """A fused part whose operators were re-planned into the memory the others left can be slower
    than its launches back to back (Kimi K2.5's dense-layer token part at 4,096 tokens: 4.26 ms
    fused, 1.03 ms launched); time_part then refuses it, and the step model times the launches."""
    from jalapeno_emu.kernels.planning import DoesNotFit
    from jalapeno_emu.rack.launch_timer import LaunchTime

    chip, layer, step, launches, builds = _replanned_part(monkeypatch)
    for launched_s, refused in ((1e-9, True), (1.0, False)):
        timer = LaunchTimer("tiny")
        each = LaunchTime(launched_s, 0.0, 0.0, "latency", 1)
        monkeypatch.setattr(timer, "time", lambda la, each=each, **kw: each)
        if refused:
            for _ in range(2):  # the refusal is remembered: one build
                with pytest.raises(DoesNotFit, match="re-planned, its launches"):
                    timer.time_part(chip, layer, step, launches)
            assert len(builds) == 1
        else:
            fig = timer.time_part(chip, layer, step, launches)
            assert 0 < fig.time_s < 1.0


def test_a_refused_fused_part_is_remembered_on_disk(monkeypatch, tmp_path):
    """A part's refusal goes into the disk cache with its kind and message, so that the next
    process (a warm sweep) raises it without building the part again."""
    from jalapeno_emu.kernels.planning import DoesNotFit
    from jalapeno_emu.rack.launch_timer import LaunchTime

    chip, layer, step, launches, builds = _replanned_part(monkeypatch)
    messages = []
    for _ in range(2):  # two processes' timers on one cache directory
        timer = LaunchTimer("tiny", disk_cache=tmp_path)
        monkeypatch.setattr(timer, "time", lambda la, **kw: LaunchTime(1e-9, 0.0, 0.0, "latency", 1))
        with pytest.raises(DoesNotFit, match="re-planned, its launches") as err:
            timer.time_part(chip, layer, step, launches)
        messages.append(str(err.value))
    assert len(builds) == 1 and messages[0] == messages[1]
