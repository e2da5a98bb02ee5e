"""The package version (its own module, so that modules needing it do not import the package API)."""

__version__ = "0.1.0"
