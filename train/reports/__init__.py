"""What a run prints: the start-up, dry-run and closing reports, the memory-fit check and the cost model's
figures beside the compiler's."""
