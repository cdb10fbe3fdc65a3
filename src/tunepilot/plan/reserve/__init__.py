"""The allocator's reserve over the allocated peak: the caching allocator replayed, and its model."""
