"""Engine integrations for radixtier."""
