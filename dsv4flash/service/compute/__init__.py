"""Compute plane of the policy service: the resident base, training and sampling over it, built-in and MinT
losses, the shared encoder / batched decoder for many adapters, and the concurrent multi-policy GRPO scheduler."""
