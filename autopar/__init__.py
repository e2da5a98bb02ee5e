"""autopar: plan and run hybrid-parallel PyTorch training."""

__version__ = "0.1.0"
