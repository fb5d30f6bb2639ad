"""Sandboxes for multi-turn rollouts, one subpackage per process that runs the code:

- `server`: the sandbox server, in each sandbox pod (`asyncgrpo sandbox serve`)
- `gateway`: the per-run gateway that leases sandboxes (`asyncgrpo gateway`)
- `client`: the trainer side (gateway client, TRL harness environment, tests-pass reward)
- `operator`: the pool-sizing rule the operator applies
- `common`: what they share (wire types, reset challenge, HTTP hardening, serving helpers)

See docs/sandboxes.md. Nothing is imported here: the server image needs no trainer code, the
trainer no server code; tests/test_layers.py holds each subpackage to its own imports.
"""
