"""Benchmarks (not tests): communication, step time, compile time, memory. See bench/run.py."""
