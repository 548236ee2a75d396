"""Stand-in: ``streaming.vision.base`` subclasses VisionDataset; the benchmark never uses it."""

from torch.utils.data import Dataset


class VisionDataset(Dataset):
    """Never instantiated by the benchmark (it reads MDS shards with StreamingDataset)."""
