"""The release checkpoint layout: which tensors a config's release has (`census`) and how each is stored
(`quant_plan`). The bridge, the integrations' weight loaders and the lifecycle's base fingerprint read it."""
