"""Model code apart from scheduling: architectures, attention, rotary, weight loading."""
