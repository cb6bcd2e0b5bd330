"""Storage tiers: GPU VRAM, host DRAM, NVMe. Imports nothing from kvstore: its own
errors (tiers/errors.py) are the roots of kvstore's error tree."""
