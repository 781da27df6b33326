"""The dpsketch analyzer: releases, estimators, baselines and evaluation.

Kept deliberately light: import the submodules you need, e.g.
``from analyzer.release import SketchRelease`` and ``from analyzer.estimators import PCA``.
"""
