"""Integrations with training frameworks; each module imports its framework only when used.

- :mod:`tiercache.integrations.dcp`: torch.distributed.checkpoint ``StorageWriter``/``StorageReader``.
- :mod:`tiercache.integrations.lightning`: a Lightning ``CheckpointIO`` plugin (extra ``lightning``).
- :mod:`tiercache.integrations.hf`: a Hugging Face ``TrainerCallback`` (extra ``hf``).
"""
