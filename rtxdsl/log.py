"""The ``rtxdsl`` logger: silent by default, ``RTXDSL_LOG=1|2`` attaches a handler (INFO | DEBUG).

A library must not print on its own: the logger carries a ``NullHandler`` and only the
environment switch (or the application's own logging setup) makes it speak. Compiles and
disk-cache hits are logged at DEBUG, cache healing and degraded caches at WARNING.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("rtxdsl")
log.addHandler(logging.NullHandler())

_LEVELS = {"1": logging.INFO, "2": logging.DEBUG}
if os.environ.get("RTXDSL_LOG") in _LEVELS and not any(
    isinstance(h, logging.StreamHandler) and not isinstance(h, logging.NullHandler) for h in log.handlers
):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("rtxdsl %(levelname)s: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(_LEVELS[os.environ["RTXDSL_LOG"]])
