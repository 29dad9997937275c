"""An independent, slow, one-object-per-request serving simulator: the oracle for simulate().

Written from the semantics in jalapeno_emu/serving/simulate.py's docstring, not from its code:
one step at a time, no stretches, plain Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jalapeno_emu.serving.simulate import length_bounds
from jalapeno_emu.serving.step_model import StepWork


@dataclass
class Req:
    rid: int
    arrival_s: float
    isl: int
    osl: int
    prefilled: int = 0
    generated: int = 0
    admitted: bool = False
    first_s: float = 0.0
    end_s: float = 0.0


def lengths(isl, osl, ratio, seed, count, block=1024):
    """The same draws as the simulator: blocks of 1024 isl, then 1024 osl, from one generator."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        a = rng.integers(length_bounds(isl, ratio)[0], isl + 1, size=block).tolist()
        b = rng.integers(length_bounds(osl, ratio)[0], osl + 1, size=block).tolist()
        out.extend(zip(a, b, strict=True))
    return out


def reference_run(model, *, isl, osl, concurrency, requests, warmup, seed=0, ratio=0.8):
    """Returns (measured requests sorted by id, window tokens, window steps, window seconds,
    window kv-bound steps, all requests, total tokens counted by steps)."""
    draws = lengths(isl, osl, ratio, seed, 20 * (concurrency + requests + warmup) + 4096)
    reqs: list[Req] = []
    live: list[Req] = []

    def issue(t):
        r = Req(len(reqs), t, *draws[len(reqs)])
        reqs.append(r)
        live.append(r)

    for _ in range(concurrency):
        issue(0.0)
    t = 0.0
    reserved = 0
    done = 0
    tokens = steps = kv_steps = 0
    start = (0, 0, 0.0, 0) if warmup == 0 else None
    first_measured = 0 if warmup == 0 else None
    while True:
        decoders = [r for r in live if r.prefilled == r.isl]
        budget = model.max_batch_tokens - len(decoders)
        chunks = []
        kv_bound = False
        for r in sorted((r for r in live if r.prefilled < r.isl), key=lambda r: r.rid):
            if budget == 0:
                break
            if not r.admitted:
                if reserved + r.isl + r.osl > model.kv_capacity_tokens:
                    kv_bound = True
                    break
                r.admitted = True
                reserved += r.isl + r.osl
            n = min(budget, r.isl - r.prefilled)
            chunks.append((r, n))
            budget -= n
        work = StepWork(tuple(r.isl + r.generated for r in decoders),
                        tuple((n, r.prefilled) for r, n in chunks))
        t += model.step_time_s(work)
        steps += 1
        kv_steps += kv_bound
        for r in decoders:
            r.generated += 1
            tokens += 1
        for r, n in chunks:
            r.prefilled += n
            tokens += n
            if r.prefilled == r.isl:
                r.generated = 1
                r.first_s = t
                tokens += 1
        finished = [r for r in live if r.generated == r.osl]
        next_id = len(reqs)
        for r in finished:
            r.end_s = t
            reserved -= r.isl + r.osl
            live.remove(r)
            done += 1
            issue(t)
        if first_measured is None and done >= warmup:
            first_measured = next_id
            start = (tokens, steps, t, kv_steps)
        if first_measured is not None and len(reqs) >= first_measured + requests and all(
                r.end_s > 0 or r.generated == r.osl for r in reqs[first_measured:first_measured + requests]):
            break
    measured = reqs[first_measured:first_measured + requests]
    return dict(measured=measured, tokens=tokens - start[0], steps=steps - start[1], seconds=t - start[2],
                kv_steps=kv_steps - start[3], all=reqs, total_tokens=tokens)
