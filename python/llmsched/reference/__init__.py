"""Naive pure-Python twins of llmsched's native structures.

They are the correctness oracles of the property tests and the baselines of the benchmarks.
They favour obviousness over speed; never use them in a request path.
"""
