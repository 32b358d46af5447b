"""``gateway bench``: replay one seeded trace through each contender (direct, our policies, peer routers)
on fresh simulated pods, and report cache hits, TTFT, E2E and throughput side by side."""
