"""Package data shipped with attnorm.

``sample.txt`` is an original English prose text (about 3,500 words) written for this project.
Examples, benchmarks and the diagnostics command use it as their default input text.
"""

from pathlib import Path

SAMPLE_TEXT_PATH = Path(__file__).with_name("sample.txt")


def read_sample_text() -> str:
    """Return the bundled sample text.

    Returns:
        The contents of ``attnorm/data/sample.txt`` (UTF-8).
    """
    return SAMPLE_TEXT_PATH.read_text(encoding="utf-8")


__all__ = ["SAMPLE_TEXT_PATH", "read_sample_text"]
