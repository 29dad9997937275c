"""pytest configuration for the MX tests."""


def pytest_configure(config):
    # The lead decides whether exact FP8 (e4m3 / e5m2) MX matmul is in scope;
    # deselect with `-m "not fp8_exact"` if it is not.
    config.addinivalue_line(
        "markers", "fp8_exact: MX matmul with FP8 (e4m3/e5m2) operands, bit-exact vs the oracle"
    )
