"""llm-d's session token (``x-session-token``) in ``llmsched serve``, on either data plane.

llm-d's ``session-affinity-scorer`` reads the request header ``x-session-token``, the base64
(standard alphabet) of the namespaced name (``namespace/name``) of a pod, and scores that pod 1;
on every answer it sets the header to the token of the pod that served. A client that echoes
the token keeps its session on one pod through any scheduler replica, with no state there.

The gateway does the same whenever a profile's filter or scorer reads the session
(``session-affinity-scorer`` / ``-filter``, :func:`~llmsched.routing.config_info`'s
``session_affinity``), naming each endpoint by its *identity*:

- engines from Kubernetes discovery (``discovery.kubernetes``): ``<namespace>/<pod name>``,
  the pod's namespaced name, so a token llm-d minted for a pod names the same engine here and
  back (the worker id of such an engine is its pod's name);
- other engines: the worker id (the entry's ``name``, else ``host:port``).

A request's token is read whatever the configuration (it reaches a ``python-scorer`` as
``session_endpoint``). Decoding takes the standard alphabet with or without its ``=`` padding
(llm-d's Go decoder requires the padding; a client that strips it is understood all the same)
and UTF-8 text; with Kubernetes discovery the text must start with the namespace and a ``/``. A
token that fails any of it, or names no engine of the pool, is ignored as llm-d ignores it (no
affinity, no error), and counted in ``llmsched_gateway_session_tokens_ignored_total``.
Precedence: a live ``x-session-id`` binding wins; the token names the session's endpoint when
the request has no session id, or one without a live binding.

>>> tokens = SessionTokens("llm")
>>> tokens.token("vllm-0")
'bGxtL3ZsbG0tMA=='
>>> tokens.endpoint("bGxtL3ZsbG0tMA"), tokens.endpoint("dmxsbS0w"), tokens.endpoint("%%%")
('vllm-0', None, None)
>>> SessionTokens(None).endpoint(SessionTokens(None).token("10.0.0.7:8000"))
'10.0.0.7:8000'
"""

from __future__ import annotations

import base64
import binascii
import re

__all__ = ["SESSION_TOKEN_HEADER", "SessionTokens"]

SESSION_TOKEN_HEADER = "x-session-token"
"""The header llm-d's session-affinity scorer reads on requests and sets on answers."""

_BASE64 = re.compile(r"[A-Za-z0-9+/]*")


class SessionTokens:
    """Mints and reads session tokens for a gateway whose Kubernetes namespace (None: engines
    not discovered from Kubernetes) is ``namespace`` (see the module doc)."""

    __slots__ = ("_prefix",)

    def __init__(self, namespace: str | None) -> None:
        self._prefix = "" if namespace is None else f"{namespace}/"

    def token(self, worker_id: str) -> str:
        """The token of the engine ``worker_id``."""
        return base64.b64encode(f"{self._prefix}{worker_id}".encode()).decode("ascii")

    def endpoint(self, token: str) -> str | None:
        """The worker id ``token`` names, or None when it is no token of this gateway's (not
        base64, not UTF-8, another namespace). Whether that engine exists is the caller's to
        check."""
        text = token.strip().rstrip("=")
        # Padding is optional; the length left must still be a base64 one (not 4n + 1).
        if len(text) % 4 == 1 or len(token.strip()) - len(text) > 2 or not _BASE64.fullmatch(text):
            return None
        try:
            name = base64.b64decode(text + "=" * (-len(text) % 4), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        if not name.startswith(self._prefix) or len(name) == len(self._prefix):
            return None
        return name[len(self._prefix) :]
