"""Tensor and model I/O: source resolution, lazy safetensors reading, sharded writing."""
