"""The reference gateway (``llmsched serve``): an OpenAI-compatible HTTP front that
tokenizes, admits through flow control, routes with the prefix-aware router and proxies to
vLLM / SGLang engines with streaming passthrough. See :class:`Gateway` and
:func:`load_config`; the README's "Gateway" section has a runnable recipe.
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

from llmsched.gateway.app import Gateway
from llmsched.gateway.config import GatewayConfig, load_config

__all__ = ["Gateway", "GatewayConfig", "load_config"]
