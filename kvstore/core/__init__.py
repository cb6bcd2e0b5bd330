"""What every layer shares and nothing of kvstore's own is beneath: errors, the
config tree, the entry layout, keys and checksums, the wire protocol, node ids.
Imports only ``tiers.errors`` (the roots of the error tree) from the project."""
