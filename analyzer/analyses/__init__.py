"""The analyses beyond ridge, least squares and PCA: one module per analysis, its estimator and its
REST route together.

* :mod:`.histogram`: statistics of a released histogram (counts, quantiles, moments, Kendall's
  tau, AUC, Gini) and their routes;
* :mod:`.lad`: least absolute deviations on an l1 study and its route, which on a gram or
  moments study fits a round of the robust regression of :mod:`.lad_rounds` (Huber rounds);
* :mod:`.logistic`: logistic regression on a gram or sketch release and its route;
* :mod:`.pilot`: the private pilot that proposes bounds, and its routes.

Each module's ``install(app, released, auth)`` adds its routes (``analyzer.app`` calls it); what
the routes do alike is in :mod:`.routes`. The estimators import no web framework, so the research
harness and the ``dpsketch study`` command use them without the analyzer extra. Ridge, least
squares and PCA (:mod:`analyzer.estimators`) are served by ``analyzer.app`` itself.
"""
