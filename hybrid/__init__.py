"""hybrid: run NVFP4/FP8 Mixture-of-Experts models on old GPUs plus a big, slow DDR pool."""

__version__ = "0.1.0"
