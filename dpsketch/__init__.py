"""dpsketch: differentially private analytics over additively shared, sketched reports."""

#: The one version of dpsketch (PEP 440): the wheel's metadata reads it (pyproject.toml), so do
#: ``dpsketch --version``, the share servers' ``/v1/info`` and the services' OpenAPI documents.
#: Between releases it is the next release's number with ``.dev0``; a release sets it to the
#: number alone and is tagged ``v<version>`` (scripts/release.sh, docs/install.md "Versions").
__version__ = "0.2.0.dev0"
