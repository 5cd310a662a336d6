"""Throughput: timed sessions, synthetic models and stores, the benchmark and its report."""
