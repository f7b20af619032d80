"""Hydra configuration, a package so that `pkg://conf` resolves after any kind of install."""
