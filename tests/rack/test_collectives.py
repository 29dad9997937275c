"""Scale-up collectives: alpha-beta formulas against hand-computed values, monotonicity, skew, errors."""

import itertools

import numpy as np
import pytest

from jalapeno_emu import chip
from jalapeno_emu.errors import InvalidArgumentError
from jalapeno_emu.rack import (
    ALGORITHMS,
    all_gather,
    all_reduce,
    all_to_all,
    best_all_gather,
    best_all_reduce,
    best_all_to_all,
    best_reduce_scatter,
    collective,
    reduce_scatter,
    schedule,
)

MIB = 2**20


@pytest.fixture(scope="module")
def v1() -> chip.ChipSpec:
    return chip.load_preset("jalapeno-v1")


@pytest.fixture(scope="module")
def ab(v1):
    """(alpha, beta, o, L): jalapeno-v1's per-message cost, s/B, set-up and path latency, by hand."""
    o, hop, switch = 1e-6, 200e-9, 250e-9
    return o + 2 * hop + switch, 1 / (16 * 100e9 * 0.9), o, 2 * hop + switch


def test_the_link_numbers_the_formulas_use_are_v1s(v1, ab):
    alpha, beta, _, _ = ab
    assert v1.link.alpha_s == pytest.approx(alpha) and 1 / v1.link.stripe_bytes_per_s == pytest.approx(beta)


N = 8 * MIB  # divisible by every p below, so n/p needs no rounding


@pytest.mark.parametrize(("op", "algorithm", "p", "expected", "steps"), [
    ("all_reduce", "ring", 8, lambda a, b, o, L: 14 * a + 2 * 7 / 8 * N * b, 14),
    ("all_reduce", "recursive_doubling", 8, lambda a, b, o, L: 3 * (a + N * b), 3),
    ("all_reduce", "recursive_doubling", 6, lambda a, b, o, L: (2 + 2) * (a + N * b), 4),  # fold in + out
    ("all_reduce", "rabenseifner", 8, lambda a, b, o, L: 6 * a + 2 * 7 / 8 * N * b, 6),
    ("all_reduce", "rabenseifner", 12, lambda a, b, o, L: 2 * (a + N * b) + 6 * a + 2 * 7 / 8 * N * b, 8),
    ("all_reduce", "one_shot", 8, lambda a, b, o, L: 7 * o + L + 7 * N * b, 1),
    ("all_reduce", "two_shot", 8, lambda a, b, o, L: 2 * (7 * o + L + 7 / 8 * N * b), 2),
    ("all_gather", "ring", 8, lambda a, b, o, L: 7 * (a + N * b), 7),
    ("all_gather", "recursive_doubling", 8, lambda a, b, o, L: 3 * a + 7 * N * b, 3),
    ("all_gather", "recursive_doubling", 6, lambda a, b, o, L: 3 * a + 5 * N * b, 3),  # Bruck: 1, 2, 2 blocks
    ("all_gather", "direct", 8, lambda a, b, o, L: 7 * o + L + 7 * N * b, 1),
    ("reduce_scatter", "ring", 8, lambda a, b, o, L: 7 * a + 7 / 8 * N * b, 7),
    ("reduce_scatter", "recursive_halving", 8, lambda a, b, o, L: 3 * a + 7 / 8 * N * b, 3),
    ("reduce_scatter", "direct", 8, lambda a, b, o, L: 7 * o + L + 7 / 8 * N * b, 1),
    ("all_to_all", "pairwise", 8, lambda a, b, o, L: 7 * (a + N * b), 7),  # N to every other chip
    ("all_to_all", "direct", 8, lambda a, b, o, L: 7 * o + L + 7 * N * b, 1),
])
def test_formulas_match_hand_computed_values(v1, ab, op, algorithm, p, expected, steps):
    t = collective(op, p, N, v1, algorithm)
    assert t.time_s == pytest.approx(expected(*ab), rel=1e-12)
    assert t.time_s == pytest.approx(t.alpha_s + t.beta_s, rel=1e-12)
    assert (t.op, t.algorithm, t.chips, t.steps) == (op, algorithm, p, steps)


def test_each_ring_step_is_one_message_of_the_chip_spec(v1):
    t = all_reduce(8, 8 * MIB, v1)
    assert t.time_s == pytest.approx(14 * v1.link.message_s(MIB))
    assert t.alpha_s == pytest.approx(14 * v1.link.alpha_s)


def test_uneven_chunks_pace_each_step_by_the_largest(v1, ab):
    alpha, beta, _, _ = ab
    t = all_reduce(4, 10, v1, "ring")  # chunks 3, 3, 2, 2 bytes
    assert t.time_s == pytest.approx(6 * alpha + 6 * 3 * beta)


def test_busiest_bytes_ring_all_reduce_moves_2_p_minus_1_over_p(v1):
    t = all_reduce(8, N, v1, "ring")
    assert t.busiest_chip_bytes == 2 * 7 * N // 8
    assert t.busiest_link_bytes == pytest.approx(t.busiest_chip_bytes / v1.link.stripe_ports)
    assert all_to_all(8, N, v1, "direct").busiest_chip_bytes == 7 * N


def test_one_chip_moves_nothing(v1):
    for op, algorithms in ALGORITHMS.items():
        for algorithm in algorithms:
            t = collective(op, 1, MIB, v1, algorithm)
            assert (t.time_s, t.steps, t.busiest_chip_bytes) == (0.0, 0, 0), (op, algorithm)


@pytest.mark.parametrize(("op", "algorithm"), [(op, a) for op, algs in ALGORITHMS.items() for a in algs])
def test_more_bytes_take_longer_and_alpha_does_not_depend_on_bytes(v1, op, algorithm):
    times = [collective(op, 16, n, v1, algorithm) for n in (1024, 64 * 1024, MIB, 16 * MIB)]
    assert all(a.time_s < b.time_s for a, b in itertools.pairwise(times))
    assert len({round(t.alpha_s, 15) for t in times}) == 1


def test_more_chips_take_longer_for_a_ring(v1):
    times = [all_reduce(p, MIB, v1, "ring").time_s for p in (2, 4, 8, 16, 64, 128)]
    assert all(a < b for a, b in itertools.pairwise(times))


def _hot_receiver(p: int, total: int, hot: int) -> np.ndarray:
    """Every chip sends half its bytes to chip `hot` and spreads the rest: the same total as uniform."""
    m = np.zeros((p, p), dtype=np.int64)
    for r in range(p):
        others = [d for d in range(p) if d != r]
        if r == hot:
            m[r, others] = total // len(others)
            continue
        m[r, hot] = total // 2
        rest = [d for d in others if d != hot]
        m[r, rest] = (total - total // 2) // len(rest)
    return m


@pytest.mark.parametrize("algorithm", ALGORITHMS["all_to_all"])
def test_skewed_all_to_all_is_slower_than_uniform_with_the_same_total(v1, algorithm):
    p, per_chip = 8, 42 * 2**17  # divisible by 2, 6 and 7: both matrices hold exactly 8 x per_chip
    uniform = np.full((p, p), per_chip // (p - 1))
    np.fill_diagonal(uniform, 0)
    skewed = _hot_receiver(p, per_chip, hot=3)
    assert skewed.sum() == uniform.sum()
    t_uniform, t_skewed = all_to_all(p, uniform, v1, algorithm), all_to_all(p, skewed, v1, algorithm)
    assert t_skewed.time_s > 1.5 * t_uniform.time_s
    # the hot chip receives 7 x 3.5 MiB: its port, not the mean, sets the bandwidth part
    assert t_skewed.busiest_chip_bytes == 7 * (per_chip // 2)


def test_direct_all_to_all_is_paced_by_the_busiest_port(v1, ab):
    _, beta, o, L = ab
    m = _hot_receiver(8, 7 * MIB, hot=0)
    t = all_to_all(8, m, v1, "direct")
    assert t.time_s == pytest.approx(7 * o + L + 7 * (7 * MIB // 2) * beta)


def test_pairwise_all_to_all_pays_each_steps_busiest_pair(v1, ab):
    alpha, beta, _, _ = ab
    m = np.zeros((4, 4), dtype=np.int64)
    m[0, 1] = 1000  # step 1 (r -> r+1): 1000 B; step 2: nothing moves; step 3: 0 <- 1 ... as m[1, 0]
    m[1, 0] = 3000
    t = all_to_all(4, m, v1, "pairwise")
    assert t.steps == 2 and t.time_s == pytest.approx(2 * alpha + (1000 + 3000) * beta)


def test_scalar_all_to_all_means_that_many_bytes_per_pair(v1):
    m = np.full((5, 5), 4096)
    assert all_to_all(5, 4096, v1).time_s == all_to_all(5, m, v1).time_s  # the diagonal stays local


@pytest.mark.parametrize(("best", "op"), [(best_all_reduce, "all_reduce"), (best_all_gather, "all_gather"),
                                          (best_reduce_scatter, "reduce_scatter"),
                                          (best_all_to_all, "all_to_all")])
def test_best_picks_the_fastest_algorithm(v1, best, op):
    for p, n in ((8, 1024), (64, MIB), (128, 64 * MIB)):
        chosen = best(p, n, v1)
        assert chosen.time_s == min(collective(op, p, n, v1, a).time_s for a in ALGORITHMS[op])


def test_small_all_reduces_are_latency_bound_and_large_ones_bandwidth_bound(v1):
    assert best_all_reduce(128, 1024, v1).algorithm == "recursive_doubling"
    big = best_all_reduce(128, 1024 * MIB, v1)
    assert big.algorithm == "rabenseifner" and big.beta_s > 10 * big.alpha_s


def test_chip_ids_and_gpu_domains(v1):
    assert all_reduce([3, 9, 20, 21], MIB, v1).time_s == all_reduce(4, MIB, v1).time_s
    gb200 = chip.load_preset("gb200-nvl72")
    assert all_reduce(72, MIB, gb200).chips == 72
    with pytest.raises(InvalidArgumentError, match=r"chips=73 exceeds gb200-nvl72's scale-up domain of 72"):
        all_reduce(73, MIB, gb200)


def test_schedule_lists_sends_and_matching_receives():
    sch = schedule("all_reduce", "ring", 4, 4000)
    assert sch.send_to.shape == (6, 4) and (sch.send_to == [1, 2, 3, 0]).all()
    assert (sch.recv_from == [3, 0, 1, 2]).all() and (sch.recv_bytes == 1000).all()
    with pytest.raises(InvalidArgumentError, match="is not stepwise"):
        schedule("all_reduce", "one_shot", 4, 4000)


@pytest.mark.parametrize(("call", "message"), [
    (lambda s: all_reduce(0, MIB, s), r"all_reduce: chips=0 must be at least 1"),
    (lambda s: all_reduce(-2, MIB, s), r"chips=-2 must be at least 1"),
    (lambda s: all_reduce([], MIB, s), r"chips=0 must be at least 1"),
    (lambda s: all_reduce([1, 1], MIB, s), r"chip ids must be distinct and non-negative"),
    (lambda s: all_reduce(129, MIB, s), r"chips=129 exceeds jalapeno-v1's scale-up domain of 128 chips"),
    (lambda s: all_reduce(8, -1, s), r"all_reduce: nbytes=-1 must be >= 0"),
    (lambda s: all_gather(8, 1.5, s), r"all_gather: nbytes must be a whole number of bytes, found 1\.5"),
    (lambda s: reduce_scatter(8, True, s), r"nbytes must be a whole number of bytes, found True"),
    (lambda s: all_to_all(8, np.ones((8, 7)), s), r"the byte matrix must be \[src, dst\] = \[8, 8\] for 8 "
                                                  r"chips, found shape \[8, 7\]"),
    (lambda s: all_to_all(2, [[0, -5], [1, 0]], s), r"finite, non-negative whole numbers of bytes"),
    (lambda s: all_to_all(2, [[0, np.nan], [1, 0]], s), r"finite, non-negative whole numbers of bytes"),
    (lambda s: all_reduce(8, MIB, s, "tree"), r"algorithm='tree' is not one of ring, recursive_doubling"),
    (lambda s: collective("broadcast", 8, MIB, s, "ring"), r"op='broadcast' is not one of all_reduce"),
])
def test_bad_input_is_one_invalid_argument_error(v1, call, message):
    with pytest.raises(InvalidArgumentError, match=message):
        call(v1)
