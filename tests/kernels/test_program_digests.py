"""Every registered kernel builds the same Program on ``tiny`` as when its digest was pinned.

A speed-up of the builder, the tiles, the allocator or an emitter must not change a Program: the
same instructions (mnemonic, engine, operands), allocations and semaphores in the same order,
issued from the same files, and the same time from the timing pass. This test pins a digest of
each kernel's Program at its default shape on ``tiny`` (source line numbers left out, so that
editing a kernel file above its emitters does not count as a change; ``benchmarks/bench_build.py
--write/--check`` compares whole Programs, lines included, on larger shapes and fused steps).

A change that is meant to change Programs updates the pins deliberately: run
``python tests/kernels/test_program_digests.py`` and paste what it prints into ``PINNED``.
"""

from __future__ import annotations

import hashlib

import pytest

from jalapeno_emu.chip import load_preset
from jalapeno_emu.emu.timing import run_timing
from jalapeno_emu.isa.program import Program, Tile
from jalapeno_emu.kernels.registry import all_kernels, get_kernel

# kernel -> (program digest, timing pass time_s), default shape on tiny
PINNED: dict[str, tuple[str, float]] = {
    'attention-decode': ('36b260442fa45bbdb598a9367440cf5ee4576d0bfc4619efecc7ba190f65b250',
                        7.815336580086578e-06),
    'attention-prefill': ('7698eb8722170d058e1c847bc3fcac7f67145ffa32c9155fb7400a483cc0f4f5',
                         2.0469715476190497e-05),
    'embedding': ('17936d95c6e9ec4637538e7232013c410e5093e19bf471c80e2369265a60b655',
                 6.589277056277057e-06),
    'gemm': ('94c57f6310307aecbcf900c041bf1a49475f0fad67f2b4a6330fbcd8160ef44f',
            6.053800865800866e-06),
    'kv-append': ('b0cccfdbc54949b237a70b6207ab28894aee0993d66adc6b740d372739f477c1',
                 5.089253896103897e-06),
    'logits': ('804d73aadec099f87a4bd9e7a39184cfe9e2353310ec76544944cba65bf8bca0',
              1.046919220779221e-05),
    'mla-append': ('ee1b201bb16026971ddbbbcd197dd19e06d7d0d5bddc0f961545ae008d592ae8',
                  5.166421645021646e-06),
    'mla-decode': ('481c75857a48928e51eba063e6e1d9cf07e757951fe30c9058a0f0be2f05ca3a',
                  8.483521969696972e-06),
    'mla-prefill': ('4f6a182ed140f9b2155a33c760a0d15d704a6b8471d5e66e8514a3e0bc6e654d',
                   1.4432994264069278e-05),
    'moe': ('7ff457a3661e8ae27e5b846426c3c7594217ef0e0b5b2528a8b9729067d9164f',
           1.108448787878788e-05),
    'rmsnorm': ('ce99d539230283d8c4f7857fd6a172336c218f675c20cb725bfe988a4498c658',
               8.289925974025973e-06),
}


def _value(v: object) -> str:
    if type(v) is Tile:
        return f"T({v.space.value},{v.core},{v.offset},{v.dtype},{v.rows},{v.cols},{v.stride})"
    return f"{type(v).__name__}:{v!r}"


def program_digest(program: Program) -> str:
    """sha256 of a canonical text of ``program`` (instructions with their source file but not
    its line, allocations, semaphores), independent of how Tile and Instruction are implemented."""
    h = hashlib.sha256(f"{program.name}|{program.preset}\n".encode())
    for ins in program.instructions:
        e = ins.engine
        ops = ",".join(f"{k}={_value(v)}" for k, v in ins.args)
        h.update(f"{ins.mnemonic}|{e.core}.{e.unit}.{e.queue}|{ops}|{ins.source.rpartition(':')[0]}\n"
                 .encode())
    for a in program.allocations:
        h.update(f"A|{a.name}|{a.space.value}|{a.core}|{a.offset}|{a.nbytes}\n".encode())
    for sem_id, name in program.semaphores:
        h.update(f"S|{sem_id}|{name}\n".encode())
    return h.hexdigest()


def _build(name: str) -> tuple[str, float]:
    spec = load_preset("tiny")
    kdef = get_kernel(name)
    program = kdef.build(kdef.shape({}), spec).program
    return program_digest(program), run_timing(program, spec).summary()["time_s"]


def _library_kernels() -> list[str]:
    """The library's kernels: not those a test registers for itself (tests/rack registers one),
    which share the registry when the tests run in one process."""
    return sorted(k.name for k in all_kernels() if k.build.__module__.startswith("jalapeno_emu.kernels."))


def test_every_kernel_is_pinned() -> None:
    assert sorted(PINNED) == _library_kernels(), (
        "a kernel was added or removed: run this file as a script and update PINNED")


@pytest.mark.parametrize("name", sorted(PINNED))
def test_program_is_unchanged(name: str) -> None:
    digest, time_s = _build(name)
    want_digest, want_time_s = PINNED[name]
    assert time_s == pytest.approx(want_time_s, rel=1e-12, abs=0), (
        f"{name}: the timing pass's time changed: {want_time_s!r} -> {time_s!r}")
    assert digest == want_digest, (
        f"{name}: its Program on tiny changed (instructions, operands, allocations, semaphores or "
        "the files that issue them); if that is intended, re-pin (see the module docstring)")


if __name__ == "__main__":
    for kdef in all_kernels():
        d, t = _build(kdef.name)
        print(f"    {kdef.name!r}: ({d!r},\n{' ' * (8 + len(kdef.name))}{t!r}),")
