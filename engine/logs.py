"""Logs of both processes: one structlog event per line on stderr, JSON or for a terminal.

The service process and the engine process each call `configure_logging` once at start, with the
same level and format (the engine gets them in its EngineConfig), so that every line on the
shared stderr has the same shape. Standard-library loggers (the engine's, and any library's:
torch, triton, asyncio, grpc), `warnings`, and exceptions that nobody caught (in any thread, or
ignored in a finalizer) go through the same processors: a traceback is the `exception` field of
its line, never lines of its own.

Imports neither torch nor grpc: both processes import it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
from types import TracebackType

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from engine.protocol.config import LOG_FORMATS, LOG_LEVELS

LEADING_FIELDS = ("timestamp", "level", "event")


def resolved_log_format(fmt: str) -> str:
    """`fmt`, with "auto" made "console" when stderr is a terminal (a person reads it) and
    "json" otherwise (a file, a pipe, a log collector). Both processes share one stderr, so
    each resolving it alone comes to the same answer."""
    if fmt != "auto":
        return fmt
    return "console" if sys.stderr.isatty() else "json"


def logs_to_stderr() -> None:
    """Where nobody configured structlog (an engine in the caller's own process), send its
    lines to stderr: structlog's default is stdout, which is the caller's (a benchmark's JSON,
    a program's output). Changes nothing where logging was configured."""
    if not structlog.is_configured():
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def configure_logging(level: str = "info", fmt: str = "json", process: str = "service") -> None:
    """Send every log of this process to stderr, one event per line; call once at start.

    `level` is one of LOG_LEVELS; `fmt` is "json" (one object per line, for machines),
    "console" (structlog's renderer, for a person at a terminal) or "auto" (either, by
    `resolved_log_format`). `process` names the process
    in each line's `process` field ("service" or "engine"). Code logs with
    `structlog.get_logger(name)` or `logging.getLogger(name)`; both end up here.
    """
    if level not in LOG_LEVELS:
        raise ValueError(f"log level: expected one of {LOG_LEVELS}, got {level!r}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format: expected one of {LOG_FORMATS}, got {fmt!r}")
    fmt = resolved_log_format(fmt)
    numeric = logging.getLevelNamesMapping()[level.upper()]
    # Run on every event: structlog's own, and (as `foreign_pre_chain`) stdlib records.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,  # request_id, where one is bound
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _ProcessFields(process),
        _enum_values,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Processor]
    if fmt == "json":
        renderer = [
            structlog.processors.format_exc_info,
            _lead_with_when_and_what,
            structlog.processors.JSONRenderer(),
        ]
    else:  # the console renderer prints a traceback itself, over several lines
        # NOTE: a plain traceback: the fancier formatters print local variables, tokens included.
        console = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
        renderer = [console]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    # NOTE: one handler writes every line, each with a single write: structlog's and the stdlib's
    # lines never interleave inside a line, whichever thread logs them.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    sys.unraisablehook = _log_unraisable


class _ProcessFields:
    """Adds `process` (which of the two processes wrote the line) and `pid`."""

    def __init__(self, process: str) -> None:
        self.process = process

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("process", self.process)
        # Read per event: a test or a tool may configure before it forks.
        event_dict.setdefault("pid", os.getpid())
        return event_dict


def _enum_values(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """An enum field (or one in a list or tuple field) as its value: the console renderer shows
    a field's repr, `<FinishReason.LENGTH: 'length'>` where a reader wants `length`."""
    for key, value in event_dict.items():
        if isinstance(value, enum.Enum):
            event_dict[key] = value.value
        elif isinstance(value, list | tuple) and any(isinstance(v, enum.Enum) for v in value):
            event_dict[key] = [v.value if isinstance(v, enum.Enum) else v for v in value]
    return event_dict


def _lead_with_when_and_what(
    logger: WrappedLogger, method_name: str, event_dict: EventDict
) -> EventDict:
    """timestamp, level and event first: the line reads left to right for a person too."""
    lead = {key: event_dict.pop(key) for key in LEADING_FIELDS if key in event_dict}
    lead.update(event_dict)
    return lead


_uncaught = structlog.get_logger("sluice.uncaught")


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """sys.excepthook: the exception that ends the main thread, as one `critical` line."""
    _uncaught.critical("uncaught_exception", exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    """threading.excepthook: as the default hook, a SystemExit ends its thread silently."""
    if args.exc_type is SystemExit:
        return
    _uncaught.critical(
        "uncaught_exception",
        thread=args.thread.name if args.thread is not None else None,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def _log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """sys.unraisablehook: an exception raised where none can propagate (a finalizer, __del__)."""
    _uncaught.error(
        "unraisable_exception",
        message=unraisable.err_msg or "Exception ignored in",
        object=_safe_repr(unraisable.object),
        exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback),
    )


def _safe_repr(obj: object) -> str | None:
    if obj is None:
        return None
    try:
        return repr(obj)
    except Exception as exc:  # a broken __repr__ must not lose the line
        return f"<{type(obj).__name__}: repr failed: {exc!r}>"
