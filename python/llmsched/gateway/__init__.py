"""The reference gateway (``llmsched serve``): an OpenAI-compatible HTTP front that
tokenizes, admits through flow control, routes with the prefix-aware router and proxies to
vLLM / SGLang engines with streaming passthrough. See :class:`Gateway` and
:func:`load_config`; docs/gateway.md has the annotated config and a runnable recipe.
Needs the ``gateway`` extra (``pip install 'llmsched[gateway]'``).
"""

from llmsched._extras import require

require(
    "gateway",
    "zmq",
    "aiohttp",
    "yarl",
    "prometheus_client",
    "tokenizers",
    "jinja2",
    feature="llmsched.gateway",
)

import os
from collections.abc import Mapping
from typing import Any

from llmsched.gateway.app import Gateway
from llmsched.gateway.config import GatewayConfig, load_config
from llmsched.gateway.native import NativeGateway

__all__ = ["Gateway", "GatewayConfig", "NativeGateway", "load_config", "make_gateway"]


def make_gateway(
    config: GatewayConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    data_plane: str | None = None,
) -> Gateway | NativeGateway:
    """The gateway of a config on its ``data_plane`` (or ``data_plane`` given here, which
    wins): :class:`Gateway` (``python``) or :class:`NativeGateway` (``native``)."""
    import dataclasses

    from llmsched.errors import ConfigError
    from llmsched.gateway.config import DATA_PLANES

    cfg = config if isinstance(config, GatewayConfig) else load_config(config)
    if data_plane is not None:
        if data_plane not in DATA_PLANES:
            raise ConfigError(f"data_plane: must be one of {', '.join(DATA_PLANES)}")
        cfg = dataclasses.replace(cfg, data_plane=data_plane)
    if cfg.data_plane == "native":
        return NativeGateway(cfg)
    return Gateway(cfg)
