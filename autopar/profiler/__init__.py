"""The profiler: measured per-layer compute/memory tables, kernel curves and collective fits.

* ``layers`` / ``kernels`` -- time and measure regions and kernels on the local device (torch).
* ``load`` / ``contention`` -- the other ranks of a CPU run as helper processes, and how a rank's
  compute slows down with their number (the contention curve).
* ``comm``    -- collectives over message sizes on N ranks, fitted to latency + bandwidth.
* ``profile_file`` -- the profile YAML: read, derive its cluster sections, write.
* the commands that drive them, ``autopar profile [--comm]`` and ``autopar validate``, are
  autopar/commands/profile.py, profile_comm.py and validate.py.

The data these write -- frozen dataclasses, YAML (de)serialisation, interpolation -- is planner
data and lives beside the cluster profiles: ``autopar.profile_tables``; the check of a run against
the conditions a profile was measured in is ``autopar.profile_conditions``.
"""
