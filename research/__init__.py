"""The research harness: the evaluations, experiments, baselines and figures behind docs/accuracy.md
and docs/experiments/, apart from the product.

Nothing here is installed with dpsketch (the wheel's packages are dpsketch, client_sdk, services,
analyzer and tools): it runs from a source checkout, ``dpsketch experiments`` or
``python -m research.<module>``, with the ``research`` extra's libraries (matplotlib, scikit-learn,
statsmodels, diffprivlib). It sits above the runtime packages and imports them (the analyzer's
estimators, releases and simulations; the client's ``prepare_batch`` to run the real pipeline in
process); none of them imports it (tests/test_layering.py).

* ``experiments``: paper 000 section 5, error ratio against n on the real code paths;
* ``evaluation``: the error-ratio benchmark and the central-model baselines on anyone's data;
* ``baselines``: SSP, AdaSSP, DGM-OLS, RMGM-OLS;
* ``accuracy_runs``, ``sketch_floor``, ``trust_cost``: the sketch kind's repeated runs, its
  predicted floor, and what trusting fewer servers costs;
* ``histogram_evaluation``, ``logistic_evaluation``, ``lad_evaluation``, ``vertical_evaluation``:
  each analysis' figures and tables; ``report`` is the scaffold they share (its ``stats`` and
  ``cell``: mean ± sd (median), p90);
* ``figures``: every accuracy figure the docs quote, from one command
  (``python -m research.figures``), through the modules above.
"""
