"""The run's token Secret: the gateway's and the sandboxes' bearer tokens.

Tokens are random and made once; the reconcile creates this Secret only when it is missing
and never rewrites it. Deleting it makes the operator create new tokens, but that alone
rotates nothing: pods read their tokens from the environment when they start, and the
operator does not restart them. Rotating is deleting the Secret and then restarting the
gateway, the trainer and the sandbox pods; until all have restarted, pods started before and
after hold different tokens and refuse each other. Tokens never appear in status, events or
logs.
"""

from __future__ import annotations

import secrets
from typing import Any

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.controller.common import metadata, name

COMPONENT = "tokens"
GATEWAY_TOKEN_KEY = "gateway-token"
SANDBOX_TOKEN_KEY = "sandbox-token"


def secret_name(run: AsyncGRPORun) -> str:
    return name(run, COMPONENT)


def build_secret(run: AsyncGRPORun, token_bytes: int = 32) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(run, COMPONENT),
        "stringData": {GATEWAY_TOKEN_KEY: secrets.token_urlsafe(token_bytes),
                       SANDBOX_TOKEN_KEY: secrets.token_urlsafe(token_bytes)},
    }
