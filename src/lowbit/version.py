"""lowbit's version (also in pyproject.toml), written into every checkpoint."""

__version__ = "0.1.0"
