"""One node's store: records and their index, holds and leases, placement over the
tiers, byte I/O and checksums, behind the ``Store`` facade the server talks to."""

from kvstore.store.facade import Store

__all__ = ["Store"]
