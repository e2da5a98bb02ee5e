"""How a rank runs: the one bring-up (``start.py``), the run command's rank (``rank_main.py``), the
training loop and its measurements, preflight checks, faults, tracing and the run's report."""
