"""autopar's commands, one module per verb (``autopar <verb>``), and ``main``, the registry and the
single place where errors become exit codes.

A command parses its arguments, calls ``autopar.api`` (or the library part it drives) and prints.
Nothing outside this package imports it (tests/unit/test_import_boundaries.py): the commands are
the top of the house.
"""
