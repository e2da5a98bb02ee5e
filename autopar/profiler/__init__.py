"""The profiler: measured per-layer compute/memory tables, kernel curves and collective fits.

* ``tables``  -- the measured-profile data (frozen dataclasses), YAML (de)serialisation and the
  interpolation the cost model uses. Pure Python: the planner imports it, never torch.
* ``layers`` / ``kernels`` -- time and measure regions and kernels on the local device (torch).
* ``comm``    -- collectives over message sizes under torchrun, fitted to latency + bandwidth.
* ``cli_profile`` / ``cli_validate`` -- ``autopar profile`` and ``autopar validate``.

This package's ``__init__`` imports nothing, so ``autopar.cluster`` can load ``tables`` cheaply.
"""
