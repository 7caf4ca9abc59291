"""Benchmarks: tiercache and its baselines (memcpy, O_DIRECT, torch.save, DCP, boto3) side by side.

Run ``python -m bench --help``; results go to ``bench/out/`` (git-ignored).
"""
