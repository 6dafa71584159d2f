"""How every tierserve process logs: its own loggers at the level asked for, everyone else's
(uvicorn, gRPC, httpx, asyncio...) at warning or above unless that level is debug, so that the
default output is tierserve's own lines (``tierserve up`` relays every child's)."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
THIRD_PARTY_FLOOR = logging.WARNING  # other libraries' INFO lines (uvicorn's start-up chatter) are noise here
OWN_LOGGERS = ("tierserve",)


def configure_logging(level: str, quiet_access_log: bool = False, **basic_config: object) -> None:
    """``level``: ``debug``, ``info``, ``warning`` or ``error``. The HTTP access log (``uvicorn.access``)
    counts as tierserve's own: one line per request at ``info`` unless ``quiet_access_log``.
    ``basic_config`` goes to ``logging.basicConfig`` (a format, a stream or handlers)."""
    own = logging.getLevelName(level.upper())
    logging.basicConfig(level=own if third_party_verbose(level) else max(own, THIRD_PARTY_FLOOR), **basic_config)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)
    logging.getLogger("uvicorn.access").setLevel(max(own, logging.WARNING) if quiet_access_log else own)


def third_party_verbose(level: str) -> bool:
    """Whether third-party logs (Mooncake's glog lines among them) show in full: at ``debug`` only."""
    return level.lower() == "debug"
