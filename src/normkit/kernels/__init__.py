"""Fast paths, chosen when a layer runs (``backend="auto"``), each tested against the reference."""
