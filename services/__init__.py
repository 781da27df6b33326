"""The dpsketch share server: one per organisation, N of them per deployment.

It stores the additive shares clients send it (durably, in SQLite), keeps the public sketch of
them up to date, and releases one aggregate share per study, once, over one inclusion set and
only if the release certificate holds. Servers never talk to each other. Run it with
``dpsketch server --help``; build it in-process with :func:`services.app.create_app`.
"""
