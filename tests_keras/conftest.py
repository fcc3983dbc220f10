"""The Keras suite's settings: Keras's own NumPy-2 deprecation notice (its tensors' ``__array__`` without ``copy``),
printed thousands of times a run, is not txl's to act on."""

from __future__ import annotations


def pytest_configure(config) -> None:  # noqa: ANN001
    config.addinivalue_line("filterwarnings", "ignore:__array__ implementation doesn't accept a copy keyword")
