"""The Transfer Engine: the only package that imports mooncake. One engine per
process (``te.Transport``), its registrations and staging buffers (``regions``),
how a batch is coalesced and split (``ranges``), its environment (``env``)."""
