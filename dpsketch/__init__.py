"""dpsketch: differentially private analytics over additively shared, sketched reports."""

__version__ = "0.1.0"
