"""The Gym side of the hand-off, as a library a Gym server mounts."""
