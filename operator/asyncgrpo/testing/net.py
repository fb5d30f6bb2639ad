"""Ports for the real servers that tests and benchmarks start: the product's own helpers
(`asyncgrpo.local.net`, which the local backend needs to place its pods), named here too so
that tests import every piece of scaffolding from `asyncgrpo.testing`."""

from asyncgrpo.local.net import free_port, listening, wait_for_port

__all__ = ["free_port", "listening", "wait_for_port"]
