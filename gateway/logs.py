"""Log format of every specgate process: time, level, logger, request id."""

from __future__ import annotations

import logging
import sys

from gateway.context import RequestIdFilter


def configure_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())  # every line says which request it belongs to
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
    for noisy in ("httpx", "uvicorn.access"):  # one line per request is the access log's job, not ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
