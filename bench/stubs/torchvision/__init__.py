"""Stand-in for torchvision: only what ``import streaming`` needs (see bench/stubs/README.md)."""
