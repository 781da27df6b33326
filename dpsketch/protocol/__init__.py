"""The dpsketch protocol: study parameters and their hash, the sketch hash, the ring codec,
noise calibration and certificate, wire formats and the error catalogue.

Clients (``client_sdk``), share servers (``services``) and the analyzer (``analyzer``) all
import these definitions; no other module computes any of them.
"""

from . import canonical, envelope, messages, privacy, problems, ring, sketch
from .problems import ProblemError
from .study import PROTOCOL, Study, design

__all__ = [
    "PROTOCOL",
    "ProblemError",
    "Study",
    "canonical",
    "design",
    "envelope",
    "messages",
    "privacy",
    "problems",
    "ring",
    "sketch",
]
