"""The sandbox server: runs in each sandbox pod (`asyncgrpo sandbox serve`, `commands`).

`app` (HTTP routes), `process` (commands, their limits and uids), `workspace`, `quota`,
`cgroup`, `residue` (what a reset removes), `stopping` (signals), `metrics`. Imports only
`asyncgrpo.sandbox.common` of the sandbox package: never the gateway nor the client.
"""
