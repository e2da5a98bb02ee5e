"""Bad model file: importing it raises."""

import autopar_no_such_module_xyz  # noqa: F401


def build_model():
    raise AssertionError("never reached")


def example_inputs(micro_batch_size):
    raise AssertionError("never reached")
