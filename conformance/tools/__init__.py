"""Maintainer tooling, apart from what a backend author uses.

The mutant catalogue and its runner (the suite's own power), the tolerance survey, golden
regeneration and checking, the reference's evidence record, and the benchmark. These use
only the public surfaces of :mod:`impl` and :mod:`conformance`.
"""
