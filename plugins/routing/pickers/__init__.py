"""The shipped pickers (entry points ``gateway.pickers``), one a module: each chooses one pod from the
candidates and their total scores, and says why."""
