"""Single-device reference model of DeepSeek-V4.1-Flash (plain PyTorch; the parity oracle)."""
