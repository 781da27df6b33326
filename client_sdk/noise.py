"""The client's mapping, clipping and noise, by their old SDK names: they are steps of the
protocol's report path (:mod:`dpsketch.protocol.report`, which holds the one implementation);
this module re-exports them for code that imports them from here."""

from dpsketch.protocol.report import (ball_rows, client_vectors, clip_rows, clipped_rows, limited_counts,
                                      noisy_encoded, privatize, privatize_encoded, row_norms)

__all__ = ["ball_rows", "client_vectors", "clip_rows", "clipped_rows", "limited_counts", "noisy_encoded",
           "privatize", "privatize_encoded", "row_norms"]
