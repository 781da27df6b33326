"""Developer and operator tools: the ``dpsketch`` command, the process launcher (cluster.py), the
haproxy front (loadbalancer.py), the demo, the load generator and the benchmarks.

They live here, outside ``dpsketch/``, because they start and drive the share servers
(``services``), the client SDK (``client_sdk``) and the analyzer (``analyzer``): the arrows run
from ``tools`` to those three, and from those three to ``dpsketch``, whose ``protocol/`` is the
I/O-free core all three import (with the shared service infrastructure beside it: serving.py,
observability.py, problem_http.py). Nothing in ``dpsketch``, ``services``, ``client_sdk`` or
``analyzer`` imports ``tools``; tests/test_layering.py checks it.
"""
