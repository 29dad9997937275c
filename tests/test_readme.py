"""The README's Python examples run as written (so the README stays true)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_block_runs(code):
    exec(compile(code, "README.md", "exec"), {})


def test_quick_start_has_exactly_two_commands():
    section = README.read_text().split("## Quick start", 1)[1].split("##", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    assert [line for line in block.splitlines() if line.strip()] == [
        "pip install -e . && jalapeno-emu demo",
        "pip install -e '.[test]' && pytest",
    ]
