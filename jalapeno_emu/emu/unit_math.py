"""The order in which the matrix and vector units sum, written in JAX for references to share.

Stage: emulator. The functional pass executes ``mxu.matmul`` and ``vec.reduce sum`` in these
orders, and the kernels' and the model's pure-JAX references call the same functions, so that
the summation order (and with it every rounding) is defined in one place. JAX loads on the first
call: the kernels import this module at start-up, and timing-only runs never call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jalapeno_emu.lazy import LazyModule

if TYPE_CHECKING:
    import jax

jnp = LazyModule("jax.numpy")
lax = LazyModule("jax.lax")

__all__ = ["inorder_block_matmul", "sequential_row_sum"]


def inorder_block_matmul(a: jax.Array, b: jax.Array, acc0: jax.Array | None = None) -> jax.Array:
    """The matrix unit's product when an operand is BF16: float32[M, N].

    Args:
        a: float32[M, K] values (K % 32 == 0), b: float32[K, N] values (dequantised if MX).
        acc0: float32[M, N] accumulators to start from (+0 when None).

    Each product of a BF16 value and an MX or BF16 value is exact in FP32 (at most 8 x 8
    significant bits) barring over- or underflow; each 32-element K block is summed in FP32 in
    increasing k, and the block sums are added to the accumulator in increasing block order.
    Kernels' pure-JAX references call this too, so the semantics live in one place.
    """
    m, k = a.shape
    n = b.shape[1]
    a_blocks = a.reshape(m, k // 32, 32).transpose(1, 2, 0)  # [nb, 32, M]
    b_blocks = b.reshape(k // 32, 32, n)  # [nb, 32, N]

    def block(acc, ab):
        a_j, b_j = ab

        def step(s, kk):
            return s + a_j[kk][:, None] * b_j[kk][None, :], None

        blk, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), jnp.arange(32))
        return acc + blk, None

    start = jnp.zeros((m, n), jnp.float32) if acc0 is None else acc0
    acc, _ = lax.scan(block, start, (a_blocks, b_blocks))
    return acc


def sequential_row_sum(x: jax.Array) -> jax.Array:
    """float32[R, 1] row sums of float32[R, C], accumulated in increasing column order (the
    vector unit's ``vec.reduce sum``; references that must match it bit for bit call this)."""
    s, _ = lax.scan(lambda acc, col: (acc + col, None), jnp.zeros((x.shape[0],), jnp.float32), x.T)
    return s[:, None]
