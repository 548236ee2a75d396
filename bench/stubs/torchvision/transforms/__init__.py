"""Stand-in for torchvision.transforms (see bench/stubs/README.md)."""
