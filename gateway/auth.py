"""Tenant API keys and the one authentication rule both front ends apply.

Keys are compared by SHA-256 digest in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from gateway.config import AuthConfig


class AuthError(Exception):
    """`status`: 401 (no key / unknown key) or 403 (key valid, method not allowed)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class KeyStore:
    def __init__(self, auth: AuthConfig, env: str | None = None):
        self._keys: list[tuple[bytes, str, frozenset[str] | None]] = []
        for k in auth.keys:
            self._keys.append((bytes.fromhex(k.key_sha256), k.tenant,
                               frozenset(k.methods) if k.methods is not None else None))
        for item in filter(None, (env if env is not None else os.environ.get("SPECGATE_API_KEYS", "")).split(",")):
            tenant, sep, key = item.strip().partition(":")
            if not sep or not tenant or not key:
                raise ValueError("SPECGATE_API_KEYS must look like 'tenant:key,tenant:key'")
            self._keys.append((hashlib.sha256(key.encode()).digest(), tenant, None))
        self.protect_metrics = auth.protect_metrics

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def lookup(self, key: str) -> tuple[str, frozenset[str] | None] | None:
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for stored, tenant, methods in self._keys:  # no early exit: timing does not reveal which key
            if hmac.compare_digest(stored, digest):
                found = (tenant, methods)
        return found

    def authenticate(self, authorization: str | None, method: str | None, request_id: str) -> str:
        """The tenant for an `Authorization: Bearer KEY` value, allowed to call
        `method` (None: any authenticated caller). '' when no keys are configured."""
        if not self.enabled:
            return ""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError(401, f"missing API key: send 'authorization: Bearer <key>' (request {request_id})")
        found = self.lookup(key.strip())
        if found is None:
            raise AuthError(401, f"unknown API key (request {request_id})")
        tenant, methods = found
        if method is not None and methods is not None and method not in methods:
            raise AuthError(403, f"tenant {tenant!r} may not call {method} (request {request_id})")
        return tenant


class WorkerToken:
    """The shared secret between gateways and `specgate engine` workers."""

    def __init__(self, token: str):
        self._digest = hashlib.sha256(token.encode()).digest() if token else b""

    @property
    def enabled(self) -> bool:
        return bool(self._digest)

    def accepts(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").partition(" ")
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(digest, self._digest)
