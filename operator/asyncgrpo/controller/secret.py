"""The run's token Secret: the gateway's and the sandboxes' bearer tokens.

Tokens are random and made once; the reconcile creates this Secret only when it is missing
and never rewrites it, so rotating is deleting it (the operator makes new ones and the pods
pick them up on restart). Tokens never appear in status, events or logs.
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
