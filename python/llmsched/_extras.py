"""Optional dependencies: which extra brings which package, and one clear error when one is missing.

``pip install llmsched`` brings only what the core needs (numpy, PyYAML). The rest comes with an
extra; a module that needs one calls :func:`require` before importing the heavy packages, so a
missing extra surfaces as one ``ImportError`` naming the extra to install instead of a bare
``No module named 'zmq'`` deep inside an import chain.

>>> require("core-check", "json", feature="this doctest")
>>> try:
...     require("sim", "llmsched_no_such_package", feature="plots")
... except ImportError as exc:
...     print(exc)
plots needs the optional package llmsched_no_such_package: pip install 'llmsched[sim]'
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "integrations": ("zmq", "aiohttp", "prometheus_client"),
    "tokenize": ("tokenizers", "jinja2"),
    "gateway": ("zmq", "aiohttp", "yarl", "prometheus_client", "tokenizers", "jinja2"),
    "sim": ("matplotlib", "tqdm"),
    "cluster": ("nats",),
    "kubernetes": ("kubernetes_asyncio", "zmq", "aiohttp", "prometheus_client"),
    "executor": ("torch", "xxhash", "msgpack"),
    "test": ("xxhash", "cbor2", "msgpack", "zmq", "aiohttp"),
}
"""The import names each runtime extra provides (pyproject.toml lists the distributions)."""


def require(extra: str, *modules: str, feature: str) -> None:
    """Raise ``ImportError`` naming ``extra`` unless every one of ``modules`` can be imported.

    Only looks the top-level packages up (no import), so the check costs microseconds;
    ``feature`` says what needs them, e.g. ``"llmsched.integrations"``.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        noun = "package" if len(missing) == 1 else "packages"
        raise ImportError(
            f"{feature} needs the optional {noun} {', '.join(missing)}: "
            f"pip install 'llmsched[{extra}]'",
            name=missing[0],
        )
