"""Hypothesis profiles for the fuzz suite (issue 13).

``ci`` (the default) is deterministic: ``derandomize`` derives every example from the test's own
source, so a CI run is reproducible and a failure is the same on every machine, and no example
database is written into the checkout. ``deep`` is for a long local hunt: random (a new seed
each run) and ten times the examples, e.g.
``JALAPENO_FUZZ_PROFILE=deep python -m pytest -n 0 tests/fuzz --hypothesis-show-statistics``
(the statistics say how often each test reached its success path).

Each test's budget is set where the test is (``tests.fuzz.helpers.fuzz_settings``, which applies
the profile's multiplier), so the whole suite stays well within a minute on two cores under ``ci``.
"""

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis keeps a cache of constants from the code under test even without an example
# database; keep it with pytest's own cache (ignored by git) rather than in a new .hypothesis/ at
# the root of the checkout.
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(__file__).resolve().parents[2] / ".pytest_cache" / "hypothesis")

# Examples that build files, compile JAX functions or run the CLI are slow by design, and array
# arguments are large; their time is bounded by each test's deadline and helpers.time_limit.
_SLOW_OR_LARGE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_OR_LARGE,
)
settings.register_profile(
    "deep",
    derandomize=False,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_OR_LARGE,
)
settings.load_profile(os.environ.get("JALAPENO_FUZZ_PROFILE", "ci"))
