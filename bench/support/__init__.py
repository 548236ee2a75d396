"""What the scenarios share: sizes and the Bench, the shaped link, peers' readers, meters."""
