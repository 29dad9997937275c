"""Session-wide test settings."""

import os

import pytest

from jalapeno_emu.emu.compile_cache import default_cache_dir, enable_compile_cache, wanted_by_environment


@pytest.fixture(scope="session", autouse=True)
def _kernel_timing_cache_in_a_temporary_directory(tmp_path_factory):
    """The rack's disk cache of kernel timings goes to a temporary directory, not the user's
    ``~/.cache/jalapeno-emu`` (the demo and the rack commands write it by default)."""
    old = os.environ.get("JALAPENO_EMU_CACHE_DIR")
    # The functional pass's compiled functions, though, stay in the user's cache, shared by the
    # test workers and kept between runs: they depend on nothing but the code being compiled.
    if wanted_by_environment():
        enable_compile_cache(default_cache_dir())
    os.environ["JALAPENO_EMU_CACHE_DIR"] = str(tmp_path_factory.mktemp("jalapeno-emu-cache"))
    yield
    if old is None:
        os.environ.pop("JALAPENO_EMU_CACHE_DIR", None)
    else:
        os.environ["JALAPENO_EMU_CACHE_DIR"] = old
