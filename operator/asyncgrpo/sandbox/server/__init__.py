"""The sandbox server: runs in each sandbox pod (`asyncgrpo sandbox serve`, `commands`).

`app` (HTTP routes), `process` (commands, their limits and uids), `workspace`, `quota`,
`cgroup`, `residue` (what a reset removes), `stopping` (signals), `metrics`, `portable` (the
bundle a task's own image runs with its python3). Imports only `asyncgrpo.sandbox.common` of
the sandbox package, never the gateway nor the client, and outside asyncgrpo only pure-Python
packages a bundle can copy (tests/test_layers.py holds it to both).
"""
