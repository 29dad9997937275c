"""The instruction table: the single source of truth for the emulated die's ISA.

Every instruction form is one frozen ``InstrSpec`` row. The checker, the binary encoder, the
assembler and disassembler, the builder, both emulator passes and the generated reference
(``isa/README.md``) all read these rows, so what the emulator accepts is exactly what the
reference documents.

Vocabulary:
- An *engine* is one in-order instruction queue: per core ``dma0..dma{Q-1}`` (DMA queues),
  ``mxu`` (matrix unit), ``vpu`` (vector unit); per chip ``link`` (scale-up link port).
  Engines written ``c{core}.{unit}`` (``c3.dma1``) or ``link``.
- A *tile* is a 2-D strided view of memory: ``space[core]:offset:dtype[rows,cols]/stride``.
  Spaces: ``hbm`` (chip-global, byte addressed), ``sram`` (per-core scratchpad), ``acc``
  (per-core FP32 accumulator memory). ``stride`` is the distance between rows in bytes
  (default: packed rows).
- Semaphores are chip-global counters that only grow: ``sem.signal`` adds, ``sem.wait`` blocks its
  engine until the counter reaches a value. Every engine may signal and wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "DTYPES",
    "LABEL_MAX_CHARS",
    "TABLE",
    "UNIT_KINDS",
    "DType",
    "InstrSpec",
    "OperandSpec",
    "Space",
    "by_mnemonic",
    "by_opcode",
]


class Space(Enum):
    """Memory spaces a tile can live in."""

    HBM = "hbm"
    SRAM = "sram"
    ACC = "acc"


@dataclass(frozen=True)
class DType:
    """A storage type of tile elements.

    Attributes:
        name: assembly spelling.
        bits: bits per element as stored (FP4 codes are packed two per byte).
        code: binary encoding id.
        mx_fmt: the ``jalapeno_emu.mx`` element format for MX element codes, else None.
        numpy: the numpy/ml_dtypes dtype name used by the functional pass for plain types.
    """

    name: str
    bits: int
    code: int
    mx_fmt: str | None = None
    numpy: str | None = None

    def row_bytes(self, cols: int) -> int:
        """Bytes one row of ``cols`` elements occupies (packed)."""
        return cols * self.bits // 8


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("f32", 32, 1, numpy="float32"),
        DType("bf16", 16, 2, numpy="bfloat16"),
        DType("f16", 16, 3, numpy="float16"),
        DType("i32", 32, 4, numpy="int32"),
        DType("u8", 8, 5, numpy="uint8"),
        DType("e8m0", 8, 6, numpy="uint8"),  # MX shared scales
        DType("fp4", 4, 7, mx_fmt="e2m1"),  # MXFP4 element codes, two per byte, low nibble first
        DType("fp8e4", 8, 8, mx_fmt="e4m3"),
        DType("fp8e5", 8, 9, mx_fmt="e5m2"),
    )
}


@dataclass(frozen=True)
class OperandSpec:
    """One operand of an instruction form.

    Attributes:
        name: operand name (assembly keyword for optional operands, builder argument name).
        kind: "tile", "imm" (signed 64-bit integer), "fimm" (float, used as float32), "enum" (one of
            ``choices``), "sem" (semaphore id, a non-negative integer) or "label" (a short text:
            non-empty, printable, at most ``LABEL_MAX_CHARS`` characters, no whitespace at
            either end).
        spaces: for tiles, the memory spaces allowed.
        dtypes: for tiles, the dtypes allowed (empty: any).
        choices: for enums, the allowed spellings (encoded by index).
        optional: may be omitted (tiles: absent; imm/enum: ``default``).
        default: value used when omitted.
        writes: True when the instruction writes this tile.
        doc: one line for the reference.
    """

    name: str
    kind: str
    spaces: tuple[Space, ...] = ()
    dtypes: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    optional: bool = False
    default: int | str | None = None
    writes: bool = False
    doc: str = ""


@dataclass(frozen=True)
class InstrSpec:
    """One instruction form.

    Attributes:
        mnemonic: assembly name, ``unit.op``.
        opcode: binary opcode (unique, < 256).
        unit: the engine kind that executes it: "dma", "mxu", "vpu", "link", or "any" (sync
            instructions run on whichever engine they are issued to).
        operands: operand specs, in assembly order.
        timing: the timing-model class ("dma", "matmul", "vector", "reduce", "sync", "link", or
            "debug": takes no time and no resource, so it never changes a timing).
        doc: one paragraph for the reference: semantics.
        rules: legality rules beyond operand spaces and dtypes, each a Python expression over
            the operands (tiles expose ``rows``, ``cols``, ``shape``, ``dtype``, ``nbytes``,
            ``row_bytes``, ``core``, ``offset``; absent optional tiles are None; ``core`` alone is
            the issuing engine's core). The checker evaluates them and the reference prints them
            verbatim.
    """

    mnemonic: str
    opcode: int
    unit: str
    operands: tuple[OperandSpec, ...]
    timing: str
    doc: str
    rules: tuple[str, ...] = ()

    def operand(self, name: str) -> OperandSpec:
        """The operand spec called ``name``."""
        for op in self.operands:
            if op.name == name:
                return op
        raise KeyError(name)


UNIT_KINDS = ("dma", "mxu", "vpu", "link", "any")

LABEL_MAX_CHARS = 64
"""The longest ``label`` operand (a probe's name), in characters."""

_SRAM = (Space.SRAM,)
_HBM = (Space.HBM,)
_ACC = (Space.ACC,)
_FLOATS = ("f32", "bf16", "f16")
_MX_A = ("fp4", "fp8e4", "fp8e5", "bf16")


def _tile(name, spaces, dtypes=(), *, writes=False, optional=False, doc=""):
    return OperandSpec(name, "tile", spaces=spaces, dtypes=dtypes, writes=writes, optional=optional, doc=doc)


def _imm(name, default=None, doc=""):
    return OperandSpec(name, "imm", optional=default is not None, default=default, doc=doc)


def _fimm(name, doc=""):
    return OperandSpec(name, "fimm", doc=doc)


def _enum(name, choices, default=None, doc=""):
    return OperandSpec(name, "enum", choices=choices, optional=default is not None, default=default, doc=doc)


_UNARY_OPS = ("copy", "exp", "rsqrt", "sigmoid", "silu", "neg", "abs", "recip", "square")
_BINARY_OPS = ("add", "sub", "mul", "max", "min")

TABLE: tuple[InstrSpec, ...] = (
    # --- DMA: HBM <-> SRAM, SRAM <-> SRAM ------------------------------------------------
    InstrSpec(
        "dma.load",
        0x01,
        "dma",
        (
            _tile("dst", _SRAM, writes=True, doc="destination tile in this core's SRAM"),
            _tile("src", _HBM, doc="source tile in HBM (strided rows)"),
        ),
        "dma",
        "Copy a strided HBM tile into SRAM. dst and src have the same dtype and shape.",
        rules=("dst.dtype == src.dtype", "dst.shape == src.shape", "dst.core == core"),
    ),
    InstrSpec(
        "dma.store",
        0x02,
        "dma",
        (
            _tile("dst", _HBM, writes=True, doc="destination tile in HBM (strided rows)"),
            _tile("src", _SRAM, doc="source tile in this core's SRAM"),
        ),
        "dma",
        "Copy an SRAM tile to a strided HBM tile. dst and src have the same dtype and shape.",
        rules=("dst.dtype == src.dtype", "dst.shape == src.shape", "src.core == core"),
    ),
    InstrSpec(
        "dma.copy",
        0x03,
        "dma",
        (
            _tile("dst", _SRAM, writes=True, doc="destination tile, any core's SRAM"),
            _tile("src", _SRAM, doc="source tile, any core's SRAM"),
        ),
        "dma",
        "Copy between SRAM tiles, across cores included. Same dtype and shape.",
        rules=("dst.dtype == src.dtype", "dst.shape == src.shape", "core in (dst.core, src.core)"),
    ),
    InstrSpec(
        "dma.gather",
        0x04,
        "dma",
        (
            _tile("dst", _SRAM, writes=True, doc="[n, cols] destination in SRAM"),
            _tile("src", _HBM, doc="[rows, cols] table in HBM; row i starts at offset + i*stride"),
            _tile("idx", _SRAM, ("i32",), doc="[n, 1] row indices into src"),
        ),
        "dma",
        "dst[i, :] = src[idx[i], :] (MoE expert weights, paged KV cache). Indices must be "
        "in [0, src.rows); the timing model prices each row as one transfer.",
        rules=(
            "dst.dtype == src.dtype",
            "dst.cols == src.cols",
            "idx.rows == dst.rows",
            "idx.cols == 1",
            "dst.core == idx.core == core",
        ),
    ),
    # --- Matrix unit ----------------------------------------------------------------------
    InstrSpec(
        "mxu.matmul",
        0x10,
        "mxu",
        (
            _tile("acc", _ACC, ("f32",), writes=True, doc="[M, N] FP32 accumulators"),
            _tile("a", _SRAM, _MX_A, doc="[M, K] left operand, blocked along K"),
            _tile("b", _SRAM, _MX_A, doc="[K, N] right operand, blocked along K"),
            _tile("a_scale", _SRAM, ("e8m0",), optional=True, doc="[M, K/32] E8M0 scales of a"),
            _tile("b_scale", _SRAM, ("e8m0",), optional=True, doc="[K/32, N] E8M0 scales of b"),
            _enum(
                "mode",
                ("overwrite", "accumulate"),
                "accumulate",
                doc="start from zero or from acc's contents",
            ),
        ),
        "matmul",
        "acc = (mode == overwrite ? +0 : acc) accumulated with the block-scaled product a @ b, "
        "one 32-element K block at a time in increasing order: exactly jalapeno_emu.mx.matmul "
        "(exact block dot, one rounding per block, FP32 RNE accumulation, no flush to zero). "
        "MX operands (fp4, fp8e4, fp8e5) need their scale tile; bf16 operands take none. When either "
        "operand is bf16 the block dot is not exact: each product of (dequantised) elements is "
        "formed in FP32 (exact, barring under/overflow; subnormal products flush on XLA CPU), the "
        "32 products of a block are summed in FP32 in increasing k, and the block sum is added to "
        "the accumulator. K must be a multiple of 32.",
        rules=(
            "acc.rows == a.rows",
            "acc.cols == b.cols",
            "a.cols == b.rows",
            "a.cols % 32 == 0",
            "(a.dtype == 'bf16') == (a_scale is None)",
            "(b.dtype == 'bf16') == (b_scale is None)",
            "a_scale is None or a_scale.shape == (a.rows, a.cols // 32)",
            "b_scale is None or b_scale.shape == (b.rows // 32, b.cols)",
            "a.core == b.core == acc.core == core",
        ),
    ),
    # --- Vector unit ----------------------------------------------------------------------
    InstrSpec(
        "vec.unary",
        0x20,
        "vpu",
        (
            _enum("op", _UNARY_OPS, doc="elementwise function"),
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, C] result (its dtype is the cast)"),
            _tile("src", _SRAM, _FLOATS, doc="[R, C] input"),
        ),
        "vector",
        "dst = op(src) computed in FP32, rounded (RNE) to dst's dtype. "
        "silu(x) = x * sigmoid(x); recip(x) = 1/x; copy casts.",
        rules=("dst.shape == src.shape", "dst.core == src.core == core"),
    ),
    InstrSpec(
        "vec.binary",
        0x21,
        "vpu",
        (
            _enum("op", _BINARY_OPS, doc="elementwise function"),
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, C] result"),
            _tile("a", _SRAM, _FLOATS, doc="[R, C] left input"),
            _tile("b", _SRAM, _FLOATS, doc="[R, C], [R, 1] or [1, C] right input (broadcast)"),
        ),
        "vector",
        "dst = op(a, b) in FP32, rounded to dst's dtype; b broadcasts along a size-1 axis.",
        rules=(
            "dst.shape == a.shape",
            "b.shape in (a.shape, (a.rows, 1), (1, a.cols))",
            "dst.core == a.core == b.core == core",
        ),
    ),
    InstrSpec(
        "vec.clamp",
        0x22,
        "vpu",
        (
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, C] result"),
            _tile("src", _SRAM, _FLOATS, doc="[R, C] input"),
            _fimm("lo", doc="lower bound"),
            _fimm("hi", doc="upper bound"),
        ),
        "vector",
        "dst = min(max(src, float32(lo)), float32(hi)) in FP32, rounded to dst's dtype.",
        rules=("dst.shape == src.shape", "lo <= hi", "dst.core == src.core == core"),
    ),
    InstrSpec(
        "vec.scale",
        0x27,
        "vpu",
        (
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, C] result"),
            _tile("src", _SRAM, _FLOATS, doc="[R, C] input"),
            _fimm("factor", doc="multiplier"),
        ),
        "vector",
        "dst = src * float32(factor) in FP32, rounded to dst's dtype.",
        rules=("dst.shape == src.shape", "dst.core == src.core == core"),
    ),
    InstrSpec(
        "vec.reduce",
        0x23,
        "vpu",
        (
            _enum("op", ("max", "sum"), doc="reduction"),
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, 1] result"),
            _tile("src", _SRAM, _FLOATS, doc="[R, C] input, reduced along C"),
        ),
        "reduce",
        "dst[r, 0] = op over c of src[r, c]; sums accumulate in FP32 in increasing c.",
        rules=("dst.shape == (src.rows, 1)", "dst.core == src.core == core"),
    ),
    InstrSpec(
        "vec.quantize",
        0x24,
        "vpu",
        (
            _tile("dst", _SRAM, ("fp4", "fp8e4", "fp8e5"), writes=True, doc="[R, C] MX element codes"),
            _tile("dst_scale", _SRAM, ("e8m0",), writes=True, doc="[R, C/32] scales"),
            _tile("src", _SRAM, _FLOATS, doc="[R, C] input, blocked along C"),
            _enum("scale_mode", ("floor", "ceil", "even", "rceil"), "floor", doc="shared-exponent rule"),
        ),
        "vector",
        "MX-quantise src along its columns, exactly jalapeno_emu.mx.quantize with "
        "block_size 32 and rounding rne.",
        rules=(
            "dst.shape == src.shape",
            "src.cols % 32 == 0",
            "dst_scale.shape == (src.rows, src.cols // 32)",
            "dst.core == dst_scale.core == src.core == core",
        ),
    ),
    InstrSpec(
        "vec.topk",
        0x25,
        "vpu",
        (
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, k] largest values, descending"),
            _tile("dst_idx", _SRAM, ("i32",), writes=True, doc="[R, k] their column indices"),
            _tile("src", _SRAM, _FLOATS, doc="[R, C] input"),
        ),
        "reduce",
        "Top-k along columns (k = dst.cols); ties go to the lower index.",
        rules=(
            "dst.rows == src.rows",
            "dst.shape == dst_idx.shape",
            "dst.cols <= src.cols",
            "dst.core == dst_idx.core == src.core == core",
        ),
    ),
    InstrSpec(
        "vec.acc_read",
        0x26,
        "vpu",
        (
            _tile("dst", _SRAM, _FLOATS, writes=True, doc="[R, C] destination in SRAM"),
            _tile("src", _ACC, ("f32",), doc="[R, C] accumulators"),
        ),
        "vector",
        "Move FP32 accumulators to SRAM, rounding (RNE) to dst's dtype.",
        rules=("dst.shape == src.shape", "dst.core == src.core == core"),
    ),
    # --- Synchronisation (any engine) -----------------------------------------------------
    InstrSpec(
        "sem.signal",
        0x30,
        "any",
        (
            OperandSpec("sem", "sem", doc="semaphore id"),
            _imm("count", 1, doc="amount added"),
        ),
        "sync",
        "Add count to the semaphore once every earlier instruction of this engine is done.",
        rules=(
            "sem >= 0",
            "count >= 1",
        ),
    ),
    InstrSpec(
        "sem.wait",
        0x31,
        "any",
        (
            OperandSpec("sem", "sem", doc="semaphore id"),
            _imm("value", doc="threshold"),
        ),
        "sync",
        "Block this engine until the semaphore's count is at least value (counts never "
        "decrease, so waits never consume).",
        rules=(
            "sem >= 0",
            "value >= 1",
        ),
    ),
    InstrSpec(
        "barrier",
        0x32,
        "any",
        (
            _imm("id", doc="barrier id"),
            _imm("count", doc="number of engines taking part"),
        ),
        "sync",
        "Block until count engines have reached barrier id (each engine reaches it once).",
        rules=(
            "id >= 0",
            "count >= 1",
        ),
    ),
    # --- Debugging (any engine) -----------------------------------------------------------
    InstrSpec(
        "probe",
        0x50,
        "any",
        (
            _tile("src", (Space.SRAM, Space.ACC, Space.HBM), doc="[R, C] tile to record (read only)"),
            OperandSpec("label", "label", doc="name the values are returned under"),
        ),
        "debug",
        "Record src's value at this point of the engine's program order; run_functional returns "
        "it in result.probes[label] (one array per probe executed, in issue order). A probe is a "
        "debugging aid, not a datapath: it takes no time and no resource (the timing pass gives it "
        "zero duration and no engine waits for it, so timing is identical with or without probes), "
        "and it may observe any memory, not only its own core's. It is a read like any other: the "
        "checker requires it to be ordered after the writes it observes (a probe of a tile a DMA "
        "may still be writing is a race) and refuses a probe of never-written scratchpad or "
        "accumulators. It runs on any engine so that a value can be observed where it is made "
        "(accumulators on the matrix unit, right after its matmul) without adding a semaphore "
        "that would change the program; on a DMA queue it is unordered with the queue's own "
        "transfers, like any transfer.",
    ),
    # --- mla ------------------------------------------------------------------------------
    InstrSpec(
        "mxu.matmul_t",
        0x68,
        "mxu",
        (
            _tile("acc", _ACC, ("f32",), writes=True, doc="[M, N] FP32 accumulators"),
            _tile("a", _SRAM, _MX_A, doc="[M, K] left operand, blocked along K"),
            _tile("b", _SRAM, _MX_A, doc="[N, K] right operand, used transposed, blocked along K"),
            _tile("a_scale", _SRAM, ("e8m0",), optional=True, doc="[M, K/32] E8M0 scales of a"),
            _tile("b_scale", _SRAM, ("e8m0",), optional=True, doc="[N, K/32] E8M0 scales of b"),
            _enum(
                "mode",
                ("overwrite", "accumulate"),
                "accumulate",
                doc="start from zero or from acc's contents",
            ),
        ),
        "matmul",
        "acc = (mode == overwrite ? +0 : acc) accumulated with a @ b^T: exactly mxu.matmul with b "
        "read transposed (the systolic array loads its stationary operand either way), so row-major "
        "keys or a row-major latent KV cache [tokens, K] serve as the right operand of q @ k^T "
        "without a transpose pass. Same numerics: one 32-element K block at a time in increasing "
        "order, FP32 RNE accumulation; MX operands need their scale tile, bf16 ones take none. "
        "K must be a multiple of 32.",
        rules=(
            "acc.rows == a.rows",
            "acc.cols == b.rows",
            "a.cols == b.cols",
            "a.cols % 32 == 0",
            "(a.dtype == 'bf16') == (a_scale is None)",
            "(b.dtype == 'bf16') == (b_scale is None)",
            "a_scale is None or a_scale.shape == (a.rows, a.cols // 32)",
            "b_scale is None or b_scale.shape == (b.rows, b.cols // 32)",
            "a.core == b.core == acc.core == core",
        ),
    ),
    # --- moe -----------------------------------------------------------------------------
    InstrSpec(
        "vec.group",
        0x60,
        "vpu",
        (
            _tile("dst", _SRAM, ("i32",), writes=True, doc="[U, 1] distinct values of src, increasing"),
            _tile("dst_w", _SRAM, _FLOATS, writes=True, doc="[U, R] weight of each row per value"),
            _tile("src", _SRAM, ("i32",), doc="[R, k] values (MoE: each token's top-k expert ids)"),
            _tile("w", _SRAM, _FLOATS, doc="[R, k] weights (MoE: each token's gate weights)"),
        ),
        "reduce",
        "Group the (row, j) pairs of src by value (MoE: tokens by expert). dst[u, 0] is the u-th "
        "smallest distinct value of src; rows of dst past the number of distinct values D repeat "
        "the largest one (so they stay valid gather indices). dst_w[u, r] = sum over j, in "
        "increasing j, of w[r, j] where src[r, j] == dst[u, 0], in FP32 rounded to dst_w's dtype, "
        "for u < D; rows u >= D are 0. More than U distinct values is an error of the functional "
        "pass (the program was built for fewer). Timed as a sort of R*k keys "
        "(ceil(log2(R*k + 1)) passes) plus U*R writes.",
        rules=(
            "dst.cols == 1",
            "dst_w.rows == dst.rows",
            "dst_w.cols == src.rows",
            "w.shape == src.shape",
            "dst.core == dst_w.core == src.core == w.core == core",
        ),
    ),
    # --- Scale-up link --------------------------------------------------------------------
    InstrSpec(
        "link.send",
        0x40,
        "link",
        (
            _tile("src", (Space.SRAM, Space.HBM), doc="data to send"),
            _imm("peer", doc="destination chip"),
            _imm("tag", doc="matches the receiver's tag"),
        ),
        "link",
        "Send a tile to chip peer over the scale-up network.",
        rules=(
            "peer >= 0",
            "tag >= 0",
        ),
    ),
    InstrSpec(
        "link.recv",
        0x41,
        "link",
        (
            _tile("dst", (Space.SRAM, Space.HBM), writes=True, doc="where the data lands"),
            _imm("peer", doc="source chip"),
            _imm("tag", doc="matches the sender's tag"),
        ),
        "link",
        "Receive the tile sent with the same tag from chip peer (same dtype and shape).",
        rules=(
            "peer >= 0",
            "tag >= 0",
        ),
    ),
)

_BY_MNEMONIC = {s.mnemonic: s for s in TABLE}
_BY_OPCODE = {s.opcode: s for s in TABLE}
assert len(_BY_MNEMONIC) == len(TABLE) and len(_BY_OPCODE) == len(TABLE)


def by_mnemonic(mnemonic: str) -> InstrSpec | None:
    """The row for ``mnemonic``, or None."""
    return _BY_MNEMONIC.get(mnemonic)


def by_opcode(opcode: int) -> InstrSpec | None:
    """The row for ``opcode``, or None."""
    return _BY_OPCODE.get(opcode)
