"""The dpsketch analyzer: releases, estimators, baselines and evaluation.

Kept deliberately light: import the submodules you need, e.g.
``from dpsketch.analyzer.release import SketchRelease`` and ``from dpsketch.analyzer.estimators import PCA``.
"""
