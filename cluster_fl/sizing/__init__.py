"""Sizing: GPU memory and activation estimates for a config, before anything is queued."""
