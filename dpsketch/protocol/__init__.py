"""The dpsketch protocol: study parameters and their hash, the sketch hash, the ring codec,
the per-report privacy accounting and noise split, the certificate, report binding, wire
formats and the error catalogue.

Clients (``client_sdk``), share servers (``services``) and the analyzer (``analyzer``) all
import these definitions; no other module computes any of them.
"""

from . import accounting, binding, canonical, envelope, messages, noise, privacy, problems, ring, sketch
from .problems import ProblemError
from .study import PROTOCOL, Study, design

__all__ = [
    "PROTOCOL",
    "ProblemError",
    "Study",
    "accounting",
    "binding",
    "canonical",
    "design",
    "envelope",
    "messages",
    "noise",
    "privacy",
    "problems",
    "ring",
    "sketch",
]
