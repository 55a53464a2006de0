"""robust: Byzantine-robust training on untrusted volunteer machines."""

__version__ = "0.1.0"
