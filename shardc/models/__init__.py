"""Reference models used by the examples, tests, benchmarks and ``python -m shardc plan``."""
