"""The generated ISA reference (isa/README.md) matches the instruction table."""

from pathlib import Path

from jalapeno_emu.isa import TABLE, reference_markdown

README = Path(__file__).resolve().parents[2] / "isa" / "README.md"


def test_generated_isa_reference_is_up_to_date():
    assert README.read_text() == reference_markdown(), (
        "isa/README.md drifted from the instruction table; regenerate with "
        "`python -m jalapeno_emu.isa.reference > isa/README.md`"
    )


def test_reference_documents_every_row_operand_and_rule_verbatim():
    text = reference_markdown()
    for spec in TABLE:
        section = text.split(f"### `{spec.mnemonic}`\n", 1)[1].split("\n### ", 1)[0]
        assert f"- opcode: `{spec.opcode:#04x}`" in section
        assert f"- timing class: `{spec.timing}`" in section
        assert spec.doc in section
        for op in spec.operands:
            assert f"| `{op.name}` |" in section, (spec.mnemonic, op.name)
        for rule in spec.rules:
            assert f"- `{rule}`" in section, (spec.mnemonic, rule)


def test_reference_includes_the_syntax_and_the_binary_layout():
    text = reference_markdown()
    assert "## Assembly syntax" in text and ".alloc hbm A 0x0 8192" in text
    assert "## Binary format" in text and 'b"JEMU"' in text
    assert "| `fp4` | 4 | 7 | e2m1 |" in text
