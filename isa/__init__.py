"""The instruction set of the emulated die (installed as ``jalapeno_emu.isa``).

Stage: ISA, right after numerics. It will hold the instruction table (the single source of truth
for mnemonics, operands, encodings, legality and timing parameters), the encoder, assembler,
disassembler and builder. Its matrix-unit instruction computes exactly ``jalapeno_emu.mx.matmul``.
Nothing is exported yet: the table lands with the emulator (issue 3).
"""

__all__: list[str] = []
