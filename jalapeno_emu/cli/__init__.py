"""Command-line interface: one module per command, registered by ``main``."""
