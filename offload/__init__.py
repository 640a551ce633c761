"""Keeping an event loop that serves many streams responsive: work by size, inline or on a thread."""
