"""What the sandbox processes share: the wire types (`messages`), the reset challenge
(`challenge`), the HTTP hardening both servers run (`http_guard`), the `prctl` calls and the
serving helpers of both commands (`serving`). Imports no other subpackage of asyncgrpo.sandbox."""
