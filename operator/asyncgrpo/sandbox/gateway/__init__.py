"""The per-run gateway (`asyncgrpo gateway`, `commands`): leases sandboxes to rollout groups.

`app` (HTTP routes, health checks, the proxied data path), `pool` (the lease pool and member
states), `members` (where the sandboxes are: pods, a file, a list), `metrics`. Imports only
`asyncgrpo.sandbox.common` of the sandbox package: never the server nor the client.
"""
