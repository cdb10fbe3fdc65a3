"""Processes tunepilot starts: the spawner, the fresh-process child, the typed messages that cross."""
