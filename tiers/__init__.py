"""Storage tiers: GPU VRAM, host DRAM, NVMe. Imports nothing from kvstore but errors."""
