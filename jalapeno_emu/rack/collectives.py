"""Scale-up collectives priced per algorithm with an alpha-beta model over the chip spec's links.

Stage: rack. The rack model and the serving sweep ask how long an all-reduce, all-gather,
reduce-scatter or all-to-all takes across ``p`` chips of one switched scale-up domain; every
number comes from the ``ChipSpec``'s ``link`` block (:class:`jalapeno_emu.chip.LinkSpec`).

The link model. Every chip reaches every other through ``switch_hops`` switches, striping one
message over ``stripe_ports`` full-duplex ports. With

    o = link.message_setup_s                      per-message set-up (descriptor, doorbell, completion)
    L = (switch_hops + 1) * latency_s + switch_hops * switch_latency_s     path latency
    alpha = o + L                                 fixed cost of one message     (LinkSpec.alpha_s)
    beta  = 1 / (stripe_ports * bytes_per_s_per_direction * efficiency)  s/B (LinkSpec.stripe_bytes_per_s)

one message of n bytes takes ``alpha + n * beta`` (``LinkSpec.message_s``), which is also what the
emulator's timing pass charges a ``link.send`` (``emu/costs.py``), so a collective written into a
kernel with :func:`jalapeno_emu.rack.emit_collective` times the same as here.

Two kinds of algorithm:

- *Stepwise* (ring, recursive doubling/halving, Rabenseifner, pairwise exchange): a sequence of
  steps; in each step every chip sends at most one message and receives at most one. Ports are
  full duplex, so a step lasts ``alpha + max over chips of max(bytes out, bytes in) * beta``: the
  busiest chip sets the pace (a skewed all-to-all is slower than a uniform one with the same
  total). A step in which no chip moves a byte is skipped.
- *Direct* (one-shot through the switch): every chip posts all its messages at once; the switch is
  non-blocking (full bisection, an assumption), so the latency is paid once, the set-up once per
  message the busiest chip posts (``m``), and the bytes stream at the busiest port's rate:
  ``m * o + L + B * beta``, B = max over chips of max(bytes sent, bytes received).

Closed forms, p chips, n bytes per chip (n/p rounds up to the largest chunk when p does not divide
n; "fold" = the 2 extra steps of (alpha + n beta) that recursive algorithms need when p is not a
power of two, p' = the largest power of two <= p):

=================  ====================  ================================================================
operation          algorithm             time
=================  ====================  ================================================================
all_reduce         ring                  2 (p-1) alpha + 2 (p-1)/p n beta
all_reduce         recursive_doubling    log2 p' (alpha + n beta)                 [+ fold]
all_reduce         rabenseifner          2 log2 p' alpha + 2 (p'-1)/p' n beta     [+ fold]
all_reduce         one_shot              (p-1) o + L + (p-1) n beta
all_reduce         two_shot              2 [(p-1) o + L + (p-1)/p n beta]
all_gather         ring                  (p-1) (alpha + n beta)
all_gather         recursive_doubling    ceil(log2 p) alpha + (p-1) n beta        (Bruck, any p)
all_gather         direct                (p-1) o + L + (p-1) n beta
reduce_scatter     ring                  (p-1) alpha + (p-1)/p n beta
reduce_scatter     recursive_halving     log2 p' alpha + (p'-1)/p' n beta    [+ 2 alpha + (n + n/p) beta]
reduce_scatter     direct                (p-1) o + L + (p-1)/p n beta
all_to_all         pairwise              sum_k=1..p-1 [alpha + max_r max(M[r, r+k], M[r-k, r]) beta]
all_to_all         direct                m o + L + max_r max(sum_d M[r, d], sum_s M[s, r]) beta
=================  ====================  ================================================================

For all_reduce and all_gather n is what each chip holds (all_gather: its contribution, the
result is p n); for reduce_scatter n is each chip's input (the result is n/p); for all_to_all M
is the [src, dst] byte matrix (its diagonal stays local and costs nothing).

What is left out: the reduction arithmetic of all_reduce/reduce_scatter (vector-unit work the
kernel schedules; at Jalapeño's vector rate it is far below the link time of the same bytes),
contention with other traffic, and in-switch reduction (NVLink SHARP-style), which no preset
assumes.

Sources: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), 2005 (ring, recursive doubling/halving, Rabenseifner,
pairwise-exchange all-to-all, and the fold for non-powers of two); P. Patarasuk, X. Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009 (ring);
J. Bruck et al., "Efficient algorithms for all-to-all communications in multiport
message-passing systems", IEEE TPDS 8(11), 1997 (all-gather for any p); one-shot/two-shot
all-reduce through a switch as in NVIDIA TensorRT-LLM's custom all-reduce.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jalapeno_emu.chip import ChipSpec, load_preset
from jalapeno_emu.errors import InvalidArgumentError

__all__ = [
    "ALGORITHMS",
    "DIRECT_ALGORITHMS",
    "CollectiveTime",
    "Schedule",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "best_all_gather",
    "best_all_reduce",
    "best_all_to_all",
    "best_reduce_scatter",
    "byte_matrix",
    "chip_ids",
    "collective",
    "reduce_scatter",
    "schedule",
]

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "recursive_doubling", "rabenseifner", "one_shot", "two_shot"),
    "all_gather": ("ring", "recursive_doubling", "direct"),
    "reduce_scatter": ("ring", "recursive_halving", "direct"),
    "all_to_all": ("pairwise", "direct"),
}
"""Operation -> its algorithms, in the order ``best_*`` breaks ties."""

DIRECT_ALGORITHMS = frozenset({"one_shot", "two_shot", "direct"})
"""Algorithms that post all messages at once (latencies overlap); the others are stepwise."""


@dataclass(frozen=True)
class CollectiveTime:
    """How long one collective takes, and why.

    Attributes:
        op: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``.
        algorithm: the algorithm priced (a name from :data:`ALGORITHMS`).
        chips: participating chips p.
        time_s: ``alpha_s + beta_s``, s.
        alpha_s: the latency part: set-ups, hops and switches, s.
        beta_s: the bandwidth part: bytes on the pacing port over the striped bandwidth, s.
        steps: sequential steps (phases for direct algorithms) that move bytes.
        busiest_chip_bytes: bytes the busiest chip sends or receives over the whole collective
            (the larger direction, all its striped ports together), B.
        busiest_link_bytes: the same on one physical port: ``busiest_chip_bytes / stripe_ports``, B.
    """

    op: str
    algorithm: str
    chips: int
    time_s: float
    alpha_s: float
    beta_s: float
    steps: int
    busiest_chip_bytes: int
    busiest_link_bytes: float


@dataclass(frozen=True)
class Schedule:
    """A stepwise algorithm's messages: in step s, chip r sends ``send_bytes[s, r]`` to chip
    ``send_to[s, r]`` (-1: nothing). Chips are numbered 0..p-1 here (positions, not chip ids).

    Attributes:
        send_to: int64[steps, p], the destination position, or -1.
        send_bytes: int64[steps, p], bytes sent (0 where ``send_to`` is -1).
        recv_from: int64[steps, p], who sends to chip r in step s, or -1.
        recv_bytes: int64[steps, p], bytes chip r receives in step s.
    """

    send_to: np.ndarray
    send_bytes: np.ndarray
    recv_from: np.ndarray
    recv_bytes: np.ndarray

    @property
    def port_bytes(self) -> np.ndarray:
        """int64[steps, p]: bytes that keep chip r's full-duplex ports busy in step s, max(out, in)."""
        return np.maximum(self.send_bytes, self.recv_bytes)


# --- argument checks ---------------------------------------------------------------------------

def _spec(spec: ChipSpec | str) -> ChipSpec:
    if isinstance(spec, str):
        return load_preset(spec)
    if not isinstance(spec, ChipSpec):
        raise InvalidArgumentError(f"spec must be a ChipSpec or a preset name, found {type(spec).__name__}")
    return spec


def chip_ids(chips: int | Sequence[int], spec: ChipSpec, what: str = "collective") -> tuple[int, ...]:
    """The participating chip ids: ``range(chips)`` for an int, else the distinct ids given.

    Raises:
        InvalidArgumentError: no chips, repeated or negative ids, or more chips than the scale-up
            domain (``link.domain_chips``) holds.
    """
    if isinstance(chips, bool):
        raise InvalidArgumentError(f"{what}: chips must be a count or a list of chip ids, found {chips!r}")
    if isinstance(chips, (int, np.integer)):
        ids = tuple(range(int(chips))) if chips > 0 else ()
        count = int(chips)
    else:
        try:
            ids = tuple(operator.index(c) for c in chips)
        except TypeError:
            raise InvalidArgumentError(f"{what}: chips must be a count or a list of integer chip ids, "
                                       f"found {chips!r}") from None
        count = len(ids)
        if len(set(ids)) != count or any(c < 0 for c in ids):
            raise InvalidArgumentError(f"{what}: chip ids must be distinct and non-negative, "
                                       f"found {list(ids)}")
    if count < 1:
        raise InvalidArgumentError(f"{what}: chips={count} must be at least 1")
    if count > spec.link.domain_chips:
        raise InvalidArgumentError(
            f"{what}: chips={count} exceeds {spec.name}'s scale-up domain of "
            f"{spec.link.domain_chips} chips (link.domain_chips)",
            hint="collectives beyond one switched domain need a scale-out network this model has not")
    return ids


def _nbytes(nbytes: Any, what: str) -> int:
    if isinstance(nbytes, bool):
        raise InvalidArgumentError(f"{what}: nbytes must be a whole number of bytes, found {nbytes!r}")
    if isinstance(nbytes, float) and nbytes.is_integer():
        nbytes = int(nbytes)
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise InvalidArgumentError(f"{what}: nbytes must be a whole number of bytes, "
                                   f"found {nbytes!r}") from None
    if n < 0:
        raise InvalidArgumentError(f"{what}: nbytes={n} must be >= 0")
    return n


def byte_matrix(matrix: Any, p: int, what: str = "all_to_all") -> np.ndarray:
    """An all-to-all's [src, dst] bytes as a validated int64[p, p] with a zero diagonal.

    Args:
        matrix: int[p, p] bytes (src row, dst column), or a scalar: that many bytes between
            every pair of distinct chips.
        p: chips.
        what: the operation named in error messages.

    Raises:
        InvalidArgumentError: a shape other than [p, p], or negative, fractional or non-finite bytes.
    """
    if np.ndim(matrix) == 0:
        n = _nbytes(matrix.item() if isinstance(matrix, np.ndarray) else matrix, what)
        out = np.full((p, p), n, dtype=np.int64)
        np.fill_diagonal(out, 0)
        return out
    try:
        arr = np.asarray(matrix, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what}: the byte matrix must be numbers, found {matrix!r}") from None
    if arr.shape != (p, p):
        raise InvalidArgumentError(f"{what}: the byte matrix must be [src, dst] = [{p}, {p}] for {p} chips, "
                                   f"found shape {list(arr.shape)}")
    if not np.isfinite(arr).all() or (arr < 0).any() or (arr != np.round(arr)).any():
        raise InvalidArgumentError(f"{what}: the byte matrix must hold finite, non-negative whole numbers "
                                   f"of bytes")
    out = arr.astype(np.int64)
    np.fill_diagonal(out, 0)  # a chip's data for itself stays local
    return out


def _algorithm(op: str, algorithm: str) -> str:
    if algorithm not in ALGORITHMS[op]:
        raise InvalidArgumentError(f"{op}: algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS[op])}")
    return algorithm


# --- schedules of the stepwise algorithms -------------------------------------------------------

def _chunks(n: int, p: int) -> np.ndarray:
    """int64[p]: n bytes split into p chunks as evenly as whole bytes allow (the first n % p get one more)."""
    return n // p + (np.arange(p) < n % p).astype(np.int64)


def _finish(send_to: np.ndarray, send_bytes: np.ndarray) -> Schedule:
    """Add each step's receives to a send table; drop steps in which nothing moves."""
    send_to = np.asarray(send_to, dtype=np.int64).reshape(-1, send_bytes.shape[-1])
    send_bytes = np.where(send_to >= 0, send_bytes, 0).astype(np.int64)
    keep = send_bytes.any(axis=1)
    send_to, send_bytes = send_to[keep], send_bytes[keep]
    steps, p = send_to.shape
    recv_from = np.full((steps, p), -1, dtype=np.int64)
    recv_bytes = np.zeros((steps, p), dtype=np.int64)
    s_idx, src = np.nonzero(send_to >= 0)
    dst = send_to[s_idx, src]
    if len(np.unique(s_idx * p + dst)) != len(dst):
        raise AssertionError("a stepwise schedule has two senders to one chip in a step")
    recv_from[s_idx, dst] = src
    recv_bytes[s_idx, dst] = send_bytes[s_idx, src]
    return Schedule(send_to, send_bytes, recv_from, recv_bytes)


def _steps(rows: list[tuple[np.ndarray, np.ndarray]], p: int) -> Schedule:
    if not rows:
        return _finish(np.zeros((0, p), dtype=np.int64), np.zeros((0, p), dtype=np.int64))
    return _finish(np.stack([r[0] for r in rows]), np.stack([np.broadcast_to(r[1], (p,)) for r in rows]))


def _fold(p: int) -> tuple[int, int]:
    """(p', extra): the largest power of two p' <= p and the p - p' chips folded onto 0..extra-1."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def _fold_step(p: int, nbytes: int | np.ndarray, into: bool) -> tuple[np.ndarray, np.ndarray]:
    """Extra chips p'..p-1 send to p'-offset partners (into) or partners 0..extra-1 send back."""
    p2, extra = _fold(p)
    r = np.arange(p)
    if into:
        return np.where(r >= p2, r - p2, -1), np.where(r >= p2, nbytes, 0)
    return np.where(r < extra, r + p2, -1), np.where(r < extra, nbytes, 0)


def _exchange(p: int, distance: int, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Chips 0..p'-1 swap nbytes with the partner r XOR distance; folded chips sit out."""
    p2, _ = _fold(p)
    r = np.arange(p)
    return np.where(r < p2, r ^ distance, -1), np.where(r < p2, nbytes, 0)


def _ring_all_reduce(p: int, n: int) -> Schedule:
    c, r = _chunks(n, p), np.arange(p)
    s = np.arange(p - 1)[:, None]
    send_bytes = np.vstack([c[(r - s) % p], c[(r + 1 - s) % p]])  # reduce-scatter, then all-gather
    return _finish(np.broadcast_to((r + 1) % p, send_bytes.shape), send_bytes)


def _recursive_doubling_all_reduce(p: int, n: int) -> Schedule:
    p2, extra = _fold(p)
    rows = [_fold_step(p, n, into=True)] if extra else []
    rows += [_exchange(p, 1 << k, n) for k in range(p2.bit_length() - 1)]
    rows += [_fold_step(p, n, into=False)] if extra else []
    return _steps(rows, p)


def _halving(p: int, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Recursive halving among p' chips: the partner distance halves while the bytes halve."""
    p2, _ = _fold(p)
    m = p2.bit_length() - 1
    return [_exchange(p, p2 >> (k + 1), -(-n // (1 << (k + 1)))) for k in range(m)]


def _rabenseifner_all_reduce(p: int, n: int) -> Schedule:
    p2, extra = _fold(p)
    m = p2.bit_length() - 1
    rows = [_fold_step(p, n, into=True)] if extra else []
    rows += _halving(p, n)  # reduce-scatter by recursive halving
    rows += [_exchange(p, 1 << k, -(-n // p2) << k) for k in range(m)]  # all-gather by doubling
    rows += [_fold_step(p, n, into=False)] if extra else []
    return _steps(rows, p)


def _ring_all_gather(p: int, n: int) -> Schedule:
    r = np.arange(p)
    return _steps([((r + 1) % p, np.full(p, n)) for _ in range(p - 1)], p)


def _bruck_all_gather(p: int, n: int) -> Schedule:
    r = np.arange(p)
    rows, k = [], 0
    while (1 << k) < p:
        rows.append(((r - (1 << k)) % p, np.full(p, min(1 << k, p - (1 << k)) * n)))
        k += 1
    return _steps(rows, p)


def _ring_reduce_scatter(p: int, n: int) -> Schedule:
    c, r = _chunks(n, p), np.arange(p)
    return _steps([((r + 1) % p, c[(r - s - 1) % p]) for s in range(p - 1)], p)


def _halving_reduce_scatter(p: int, n: int) -> Schedule:
    _, extra = _fold(p)
    rows = [_fold_step(p, n, into=True)] if extra else []
    rows += _halving(p, n)
    rows += [_fold_step(p, -(-n // p), into=False)] if extra else []
    return _steps(rows, p)


def _pairwise_all_to_all(p: int, matrix: np.ndarray) -> Schedule:
    r = np.arange(p)
    return _steps([((r + k) % p, matrix[r, (r + k) % p]) for k in range(1, p)], p)


_STEPWISE: dict[tuple[str, str], Callable[[int, Any], Schedule]] = {
    ("all_reduce", "ring"): _ring_all_reduce,
    ("all_reduce", "recursive_doubling"): _recursive_doubling_all_reduce,
    ("all_reduce", "rabenseifner"): _rabenseifner_all_reduce,
    ("all_gather", "ring"): _ring_all_gather,
    ("all_gather", "recursive_doubling"): _bruck_all_gather,
    ("reduce_scatter", "ring"): _ring_reduce_scatter,
    ("reduce_scatter", "recursive_halving"): _halving_reduce_scatter,
    ("all_to_all", "pairwise"): _pairwise_all_to_all,
}


def _direct_phases(op: str, algorithm: str, p: int, payload: Any) -> list[np.ndarray]:
    """The [src, dst] byte matrices a direct algorithm posts at once, one per phase."""
    off = ~np.eye(p, dtype=bool)
    if op == "all_to_all":
        return [payload]
    n = payload
    if op == "all_gather" or algorithm == "one_shot":
        return [np.where(off, n, 0)]
    chunks = np.where(off, _chunks(n, p)[None, :], 0)  # chip r sends chunk d to d
    if op == "reduce_scatter":
        return [chunks]
    return [chunks, chunks.T.copy()]  # two_shot: reduce-scatter, then each sends its chunk to all


def schedule(op: str, algorithm: str, p: int, payload: int | np.ndarray) -> Schedule:
    """The stepwise schedule of ``op`` by ``algorithm`` over p chips (positions 0..p-1).

    Args:
        op, algorithm: a stepwise pair from :data:`ALGORITHMS` (not one_shot/two_shot/direct).
        p: chips, >= 1.
        payload: n bytes per chip, or the int64[p, p] byte matrix for all_to_all.

    Raises:
        InvalidArgumentError: a direct algorithm (it has no steps) or an unknown pair.
    """
    key = (op, algorithm)
    if key not in _STEPWISE:
        raise InvalidArgumentError(f"{op}: algorithm={algorithm!r} is not stepwise; stepwise ones are "
                                   f"{', '.join(a for o, a in _STEPWISE if o == op)}")
    if p == 1:
        return _steps([], 1)
    return _STEPWISE[key](p, payload)


# --- pricing -----------------------------------------------------------------------------------

def _priced(op: str, algorithm: str, p: int, payload: Any, spec: ChipSpec) -> CollectiveTime:
    link = spec.link
    beta = 1.0 / link.stripe_bytes_per_s
    if algorithm in DIRECT_ALGORITHMS:
        alpha_s = beta_s = 0.0
        steps = busiest = 0
        sent = np.zeros(p, dtype=np.int64)
        received = np.zeros(p, dtype=np.int64)
        for phase in _direct_phases(op, algorithm, p, payload) if p > 1 else []:
            out, inn = phase.sum(axis=1), phase.sum(axis=0)
            pace = int(max(out.max(), inn.max()))
            if pace == 0:
                continue
            messages = int((phase > 0).sum(axis=1).max())
            alpha_s += messages * link.message_setup_s + link.path_latency_s
            beta_s += pace * beta
            steps += 1
            sent += out
            received += inn
        busiest = int(max(sent.max(), received.max()))
    else:
        sch = schedule(op, algorithm, p, payload)
        steps = sch.send_to.shape[0]
        alpha_s = steps * link.alpha_s
        beta_s = float(sch.port_bytes.max(axis=1).sum()) * beta if steps else 0.0
        busiest = int(max(sch.send_bytes.sum(axis=0).max(), sch.recv_bytes.sum(axis=0).max())) if steps else 0
    return CollectiveTime(op=op, algorithm=algorithm, chips=p, time_s=alpha_s + beta_s, alpha_s=alpha_s,
                          beta_s=beta_s, steps=steps, busiest_chip_bytes=busiest,
                          busiest_link_bytes=busiest / link.stripe_ports)


def _payload(op: str, p: int, nbytes: Any) -> int | np.ndarray:
    return byte_matrix(nbytes, p, op) if op == "all_to_all" else _nbytes(nbytes, op)


def collective(op: str, chips: int | Sequence[int], nbytes: Any, spec: ChipSpec | str,
               algorithm: str) -> CollectiveTime:
    """Price one collective; :func:`all_reduce` and friends call this.

    Args:
        op: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or ``"all_to_all"``.
        chips: a count p, or the participating chip ids (at most ``link.domain_chips``).
        nbytes: bytes per chip (see the module docstring for each op), or for all_to_all the
            [src, dst] byte matrix (int[p, p]) or a scalar (that many bytes between every pair).
        spec: the chip (a ChipSpec or preset name); only its ``link`` block is read.
        algorithm: one of ``ALGORITHMS[op]``.

    Raises:
        InvalidArgumentError: unknown op or algorithm, no chips, more chips than the domain,
            negative or fractional bytes, a byte matrix of the wrong shape.
    """
    if op not in ALGORITHMS:
        raise InvalidArgumentError(f"op={op!r} is not one of {', '.join(ALGORITHMS)}")
    spec = _spec(spec)
    p = len(chip_ids(chips, spec, op))
    return _priced(op, _algorithm(op, algorithm), p, _payload(op, p, nbytes), spec)


def all_reduce(chips: int | Sequence[int], nbytes: int, spec: ChipSpec | str,
               algorithm: str = "ring") -> CollectiveTime:
    """Time to all-reduce ``nbytes`` held by each of ``chips`` (every chip ends with the sum).

    Algorithms: ring, recursive_doubling, rabenseifner, one_shot, two_shot (formulas in the
    module docstring). Example: 1 MiB over 8 jalapeno-v1 chips by ring is 14 steps.
    """
    return collective("all_reduce", chips, nbytes, spec, algorithm)


def all_gather(chips: int | Sequence[int], nbytes: int, spec: ChipSpec | str,
               algorithm: str = "ring") -> CollectiveTime:
    """Time to all-gather ``nbytes`` from each chip (every chip ends with p x nbytes).

    Algorithms: ring, recursive_doubling (Bruck's, any p), direct.
    """
    return collective("all_gather", chips, nbytes, spec, algorithm)


def reduce_scatter(chips: int | Sequence[int], nbytes: int, spec: ChipSpec | str,
                   algorithm: str = "ring") -> CollectiveTime:
    """Time to reduce-scatter ``nbytes`` held by each chip (each ends with its reduced nbytes / p).

    Algorithms: ring, recursive_halving, direct.
    """
    return collective("reduce_scatter", chips, nbytes, spec, algorithm)


def all_to_all(chips: int | Sequence[int], nbytes: Any, spec: ChipSpec | str,
               algorithm: str = "pairwise") -> CollectiveTime:
    """Time to exchange ``nbytes[src, dst]`` bytes between every pair (MoE dispatch and combine).

    Args:
        nbytes: int[p, p] bytes chip src sends chip dst (the diagonal stays local), or a scalar
            for a uniform exchange. A skewed matrix is paced by its busiest sender or receiver.

    Algorithms: pairwise (p - 1 exchange steps), direct (everything posted at once).
    """
    return collective("all_to_all", chips, nbytes, spec, algorithm)


def _best(op: str, chips: int | Sequence[int], nbytes: Any, spec: ChipSpec | str) -> CollectiveTime:
    spec = _spec(spec)
    p = len(chip_ids(chips, spec, op))
    payload = _payload(op, p, nbytes)
    return min((_priced(op, a, p, payload, spec) for a in ALGORITHMS[op]), key=lambda t: t.time_s)


def best_all_reduce(chips: int | Sequence[int], nbytes: int, spec: ChipSpec | str) -> CollectiveTime:
    """The fastest all-reduce algorithm for this size and chip count (ties: the first listed)."""
    return _best("all_reduce", chips, nbytes, spec)


def best_all_gather(chips: int | Sequence[int], nbytes: int, spec: ChipSpec | str) -> CollectiveTime:
    """The fastest all-gather algorithm for this size and chip count."""
    return _best("all_gather", chips, nbytes, spec)


def best_reduce_scatter(chips: int | Sequence[int], nbytes: int, spec: ChipSpec | str) -> CollectiveTime:
    """The fastest reduce-scatter algorithm for this size and chip count."""
    return _best("reduce_scatter", chips, nbytes, spec)


def best_all_to_all(chips: int | Sequence[int], nbytes: Any, spec: ChipSpec | str) -> CollectiveTime:
    """The fastest all-to-all algorithm for this byte matrix."""
    return _best("all_to_all", chips, nbytes, spec)
