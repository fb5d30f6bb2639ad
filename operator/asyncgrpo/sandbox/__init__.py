"""Sandboxes for multi-turn rollouts: server (per pod), gateway (per run), client, pool sizing,
the TRL harness environment and the tests-pass reward. See docs/sandboxes.md.

Nothing is imported here: the server image needs no trainer code, the trainer no server code.
"""
