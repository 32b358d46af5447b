"""The preparers the scorers share, one a module: each computes, once per attempt, what its scorers and
pickers read (named in their ``needs``; not found by name)."""
