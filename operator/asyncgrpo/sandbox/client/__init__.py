"""The trainer side: `gateway_client` (leases, calls, heartbeats), `environment` (the TRL
harness environment and `SandboxHandle`), `rewards` (the `sandbox_tests` reward). Imports only
`asyncgrpo.sandbox.common` of the sandbox package: never the server nor the gateway.
"""
