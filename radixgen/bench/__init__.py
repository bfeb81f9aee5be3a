"""Benchmarks that ship with the package (``radixgen bench ...``)."""
