"""The platform tests' hosts: the multi-host tests' network namespaces (``hosts``)."""

from tests.multihost.conftest import hosts, namespaces_usable  # noqa: F401  (fixtures)
