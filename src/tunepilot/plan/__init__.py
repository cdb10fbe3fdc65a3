"""Stage 1, the memory plan: one entry point (api.make_plan), a room per way of planning."""
