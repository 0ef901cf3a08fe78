"""moetool: build Mixture-of-Experts models from domain experts and ship them to devices."""

__version__ = "0.1.0"
