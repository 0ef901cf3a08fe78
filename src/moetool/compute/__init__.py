"""How a model computes over the weights it stores: float32 arithmetic over 16-bit tensors, one layer at a time."""
