"""Placement policies: the contract, the built-ins, and the throughput meter they read."""
