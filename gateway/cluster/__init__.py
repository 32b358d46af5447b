"""Many gateway processes acting as one: worker processes on one port, and the state they share."""
