"""The TUI's screens, one per file."""
