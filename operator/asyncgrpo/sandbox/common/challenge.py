"""The reset handshake: the gateway and a sandbox prove themselves to each other, and the
run's sandbox token never travels.

Why: whatever answers at a sandbox's address gets the gateway's reset. If that is a process a
command left behind (it bound the port when the real server stopped), a reset carrying the
token as a bearer credential, and the next lease's secret in clear, handed both to the
attacker: it then served the next group. So the token is only a key here, known to the
gateway and to the sandbox server since it started (from its environment or a file, then
removed from its environment; the process is non-dumpable), and never sent:

- the gateway's reset credential (`Authorization: Bearer r1.<...>`) is an HMAC over a fresh
  random nonce, the time it was made and the sandbox's address (`audience`); the next lease's
  secret rides in it sealed (XOR with an HMAC keystream of the nonce: readable only with the
  token) and covered by the MAC. The server accepts it once (nonces are remembered for the
  validity window), within `WINDOW_SECONDS` of its time, and only on the address it names, so
  a credential captured by an impostor opens nothing, at that sandbox or at another;
- the sandbox's answer carries `proof` = HMAC(token, nonce): only a process that knows the
  token can make it, so the gateway admits no impostor to the pool (`ResetCall.proven_by`).

Health checks carry no credential at all (`/healthz` is open).

What the gateway calls, per reset (`reset_member`):

    call = reset_call(sandbox_token, member_url, lease_secret)   # lease_secret None: revoke only
    status, answer = POST f"{member_url}/v1/reset", headers=call.headers, body=call.body
    ok = status == 200 and call.proven_by(answer)                  # else: not a sandbox of ours

Only the standard library (the trainer and gateway images import this too).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

VERSION = "r1"
#: how long a reset credential is accepted after it was made (clocks of one cluster)
WINDOW_SECONDS = 120.0
MAX_SECRET_BYTES = 256


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _key(token: str, label: bytes) -> bytes:
    return hmac.new(token.encode(), b"asyncgrpo-sandbox-reset/" + label, hashlib.sha256).digest()


def _keystream(token: str, nonce: bytes, n: int) -> bytes:
    key = _key(token, b"seal")
    out = b"".join(hmac.new(key, nonce + i.to_bytes(4, "big"), hashlib.sha256).digest()
                   for i in range((n + 31) // 32))
    return out[:n]


def _seal(token: str, nonce: bytes, data: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(data, _keystream(token, nonce, len(data)), strict=True))


def _mac(token: str, issued: str, audience: str, nonce: bytes, sealed: bytes) -> bytes:
    msg = b"\0".join([VERSION.encode(), issued.encode(), audience.encode(), nonce, sealed])
    return hmac.new(_key(token, b"mac"), msg, hashlib.sha256).digest()


def proof(token: str, nonce: bytes) -> str:
    """The sandbox's answer to a reset: shows it knows the token without showing the token."""
    return _b64(hmac.new(_key(token, b"proof"), nonce, hashlib.sha256).digest())


def audience_of(url: str) -> str:
    """`host:port` of a sandbox base URL, as the credential names it."""
    parsed = urlparse(url)
    return f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}"


@dataclass(frozen=True)
class ResetCall:
    """One reset as the gateway sends it; `proven_by` checks the sandbox's answer."""

    nonce: bytes
    headers: dict[str, str]
    body: bytes = b"{}"
    _token: str = field(default="", repr=False)

    def proven_by(self, answer: bytes | str | dict) -> bool:
        try:
            data = answer if isinstance(answer, dict) else json.loads(answer)
            presented = data.get("proof")
        except (ValueError, AttributeError):
            return False
        return isinstance(presented, str) and hmac.compare_digest(presented.encode(),
                                                                  proof(self._token, self.nonce).encode())


def reset_call(token: str, url: str, lease_secret: str | None = None, *, now: float | None = None) -> ResetCall:
    """The gateway's side: headers and body of a reset of the sandbox at `url`."""
    if not token:
        raise ValueError("the sandbox token is required")
    secret = (lease_secret or "").encode()
    if len(secret) > MAX_SECRET_BYTES:
        raise ValueError(f"a lease secret is at most {MAX_SECRET_BYTES} bytes")
    nonce = secrets.token_bytes(24)
    issued = f"{time.time() if now is None else now:.3f}"
    audience = audience_of(url)
    sealed = _seal(token, nonce, secret)
    mac = _mac(token, issued, audience, nonce, sealed)
    credential = ".".join([VERSION, issued, _b64(audience.encode()), _b64(nonce), _b64(sealed), _b64(mac)])
    return ResetCall(nonce, {"authorization": f"Bearer {credential}"}, _token=token)


@dataclass(frozen=True)
class ResetTicket:
    """A reset credential whose MAC held: what the sandbox server checks next and uses."""

    nonce: bytes
    issued: float
    audience: str
    lease_secret: str | None = field(repr=False)

    def fresh(self, now: float | None = None) -> bool:
        return abs((time.time() if now is None else now) - self.issued) <= WINDOW_SECONDS

    def addressed_to(self, host: str, port: int) -> bool:
        """The credential names this server's address: the port always, the host when the
        gateway named it by IP (a name, e.g. `localhost`, was resolved on the gateway's side)."""
        name, _, want_port = self.audience.rpartition(":")
        if want_port != str(port):
            return False
        try:
            return ipaddress.ip_address(name.strip("[]")) == ipaddress.ip_address(host)
        except ValueError:
            return True


def open_reset(token: str, credential: str | None) -> ResetTicket | None:
    """The server's side: the ticket inside a reset credential, or None (not the gateway's)."""
    if not credential or not credential.startswith(VERSION + "."):
        return None
    parts = credential.split(".")
    if len(parts) != 7:  # r1, issued (a float: two parts), audience, nonce, sealed, mac
        return None
    _, whole, frac, audience_b64, nonce_b64, sealed_b64, mac_b64 = parts
    issued = f"{whole}.{frac}"
    try:
        audience = _unb64(audience_b64).decode()
        nonce, sealed, mac = _unb64(nonce_b64), _unb64(sealed_b64), _unb64(mac_b64)
        issued_at = float(issued)
    except ValueError:
        return None
    if len(nonce) < 16 or len(sealed) > MAX_SECRET_BYTES:
        return None
    if not hmac.compare_digest(mac, _mac(token, issued, audience, nonce, sealed)):
        return None
    secret = _seal(token, nonce, sealed)
    try:
        lease_secret = secret.decode() if secret else None
    except UnicodeDecodeError:
        return None
    return ResetTicket(nonce, issued_at, audience, lease_secret)


class NonceLedger:
    """Nonces of accepted resets, kept for the validity window: each credential opens once."""

    def __init__(self, window: float = WINDOW_SECONDS):
        self.window = window
        self._seen: dict[bytes, float] = {}

    def admit(self, nonce: bytes, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if len(self._seen) > 1024:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * self.window}
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True
