"""Alerts: sessions' reasons for attention sent to webhook sinks (``engine``), signed and retried (``dispatch``)."""

from .dispatch import Dispatcher, Job, RetryPolicy, payload
from .engine import AlertEngine

__all__ = ["AlertEngine", "Dispatcher", "Job", "RetryPolicy", "payload"]
