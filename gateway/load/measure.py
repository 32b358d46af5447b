"""``gateway profiles measure``: fit a GPU profile (AIBrix format) from a short sweep against one pod.

For each (output, input) size on the grid, requests arrive at increasing rates for a few seconds each;
the profile's throughput there is the highest rate whose latencies (at the SLO percentile) still meet
the SLOs, with the mean latencies measured at that rate. A size that misses the SLOs even at the lowest
rate gets throughput 0.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp
import orjson

from gateway.load.slo_profiles import GpuProfile, Slos

log = logging.getLogger("gateway.load.measure")

WORDS = ["cache", "prefix", "router", "token", "block", "engine", "agent", "stage", "latency", "pod", "gpu"]


@dataclass(slots=True)
class Sample:
    ttft_s: float
    e2e_s: float
    output_tokens: int
    ok: bool


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))]


class ProfileMeasurer:
    def __init__(self, pod_url: str, model: str, deployment: str, *, outputs: list[int], inputs: list[int],
                 rates: list[float], seconds_per_rate: float, slos: Slos, seed: int = 0) -> None:
        self.pod_url = pod_url.rstrip("/")
        self.model = model
        self.deployment = deployment
        self.outputs, self.inputs, self.rates = outputs, inputs, sorted(rates)
        self.seconds_per_rate = seconds_per_rate
        self.slos = slos
        self._rng = random.Random(seed)

    def _prompt(self, tokens: int) -> str:
        # A unique head keeps the prefix cache from flattering the numbers; ~1 token per word.
        return f"{self._rng.random()} " + " ".join(self._rng.choice(WORDS) for _ in range(max(1, tokens - 4)))

    async def _one(self, session: aiohttp.ClientSession, inputs: int, outputs: int) -> Sample:
        body = {"model": self.model, "prompt": self._prompt(inputs), "max_tokens": outputs, "min_tokens": outputs,
                "ignore_eos": True, "stream": True}
        started = time.perf_counter()
        first = None
        tokens = 0
        try:
            async with session.post(f"{self.pod_url}/v1/completions", data=orjson.dumps(body),
                                    headers={"content-type": "application/json"}) as resp:
                if resp.status != 200:
                    return Sample(0, 0, 0, False)
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        first = first or time.perf_counter()
                        tokens += 1
        except aiohttp.ClientError:
            return Sample(0, 0, 0, False)
        end = time.perf_counter()
        return Sample((first or end) - started, end - started, tokens, True)

    async def _at_rate(self, session: aiohttp.ClientSession, inputs: int, outputs: int, rate: float) -> list[Sample]:
        tasks = []
        deadline = time.perf_counter() + self.seconds_per_rate
        while time.perf_counter() < deadline:
            tasks.append(asyncio.create_task(self._one(session, inputs, outputs)))
            await asyncio.sleep(self._rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))

    def _meets(self, samples: list[Sample]) -> bool:
        if not samples or not all(s.ok for s in samples):
            return False
        pct = self.slos.percentile or 90
        if self.slos.e2e is not None and percentile([s.e2e_s for s in samples], pct) > self.slos.e2e:
            return False
        return not (self.slos.ttft is not None and percentile([s.ttft_s for s in samples], pct) > self.slos.ttft)

    async def measure(self) -> GpuProfile:
        rows = len(self.outputs)
        tputs = [[0.0] * len(self.inputs) for _ in range(rows)]
        e2e = [[0.0] * len(self.inputs) for _ in range(rows)]
        ttft = [[0.0] * len(self.inputs) for _ in range(rows)]
        tpot = [[0.0] * len(self.inputs) for _ in range(rows)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for o, outputs in enumerate(self.outputs):
                for i, inputs in enumerate(self.inputs):
                    for rate in self.rates:
                        samples = await self._at_rate(session, inputs, outputs, rate)
                        if not self._meets(samples):
                            break
                        tputs[o][i] = rate
                        e2e[o][i] = statistics.fmean(s.e2e_s for s in samples)
                        ttft[o][i] = statistics.fmean(s.ttft_s for s in samples)
                        tpot[o][i] = statistics.fmean((s.e2e_s - s.ttft_s) / max(1, s.output_tokens - 1)
                                                      for s in samples)
                    log.info("output %d, input %d: %.2f req/s within the SLOs", outputs, inputs, tputs[o][i])
        return GpuProfile(gpu=self.deployment, indexes=[list(map(float, self.outputs)), list(map(float, self.inputs))],
                          tputs=tputs, e2e=e2e, ttft=ttft, tpot=tpot, created=time.time(), slos=self.slos)
