"""Test support: the fault injection the tests plug into tunepilot's hooks (child processes via
TUNEPILOT_CHILD_HOOK, the restore proof via its hook object). None of it is in the library."""
