"""``gateway profiles load|show|measure``: GPU profiles between files, Redis and pods."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import msgspec

from gateway.load.slo_profiles import KEY_PREFIX, GpuProfile, Slos, parse_key, profile_key


def add_profiles_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profiles", help="GPU profiles: load into Redis, show, measure a pod")
    ps = p.add_subparsers(dest="profiles_command", required=True)
    load = ps.add_parser("load", help="write profile JSON files to Redis")
    load.add_argument("files", nargs="+")
    load.add_argument("--redis", required=True)
    load.add_argument("--model", help="model name (default: from the file name profile_<model>_<deployment>.json"
                                      " or the file's model field)")
    show = ps.add_parser("show", help="list the profiles in Redis")
    show.add_argument("--redis", required=True)
    m = ps.add_parser("measure", help="fit a profile from a short sweep against a pod")
    m.add_argument("--pod", required=True)
    m.add_argument("--model", required=True)
    m.add_argument("--deployment", required=True)
    m.add_argument("--outputs", default="4,16,64", help="output-token grid")
    m.add_argument("--inputs", default="128,512,2048", help="input-token grid")
    m.add_argument("--rates", default="1,2,4,8,16", help="request rates to try, req/s")
    m.add_argument("--seconds", type=float, default=3.0, help="seconds per rate")
    m.add_argument("--slo-ttft-ms", type=float, default=1000)
    m.add_argument("--slo-e2e-ms", type=float, default=10000)
    m.add_argument("--percentile", type=float, default=90)
    m.add_argument("--out", help="file to write (default profiles/profile_<model>_<deployment>.json)")
    m.add_argument("--redis", help="also write it to this Redis")


def model_and_deployment(path: Path, profile: GpuProfile, model: str | None) -> tuple[str, str]:
    stem = path.stem
    if model:
        return model, profile.gpu
    parsed = parse_key(KEY_PREFIX + stem[len("profile_"):], []) if stem.startswith("profile_") else None
    if parsed:
        return parsed[0], profile.gpu
    raise SystemExit(f"{path}: name it profile_<model>_<deployment>.json or pass --model")


async def load(files: list[str], redis_url: str, model: str | None) -> int:
    import redis.asyncio as redis

    client = redis.from_url(redis_url)
    try:
        for name in files:
            path = Path(name)
            try:
                profile = msgspec.json.decode(await asyncio.to_thread(path.read_bytes), type=GpuProfile)
            except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
                print(f"{path}: {exc}", file=sys.stderr)
                return 2
            key = profile_key(*model_and_deployment(path, profile, model))
            await client.set(key, msgspec.json.encode(profile))
            print(f"{key} <- {path}")
    finally:
        await client.aclose()
    return 0


async def show(redis_url: str) -> int:
    import redis.asyncio as redis

    client = redis.from_url(redis_url)
    try:
        keys = sorted([k.decode() async for k in client.scan_iter(match=f"{KEY_PREFIX}*")])
        for key in keys:
            profile = msgspec.json.decode(await client.get(key), type=GpuProfile)
            outputs, inputs = profile.indexes
            print(f"{key}: deployment {profile.gpu}, created {profile.created:.0f}, grid {len(outputs)}x{len(inputs)}"
                  f", max {max(max(r) for r in profile.tputs):.2f} req/s")
    finally:
        await client.aclose()
    return 0


async def measure(args: argparse.Namespace) -> int:
    from gateway.load.measure import ProfileMeasurer

    slos = Slos(percentile=args.percentile, ttft=args.slo_ttft_ms / 1000, e2e=args.slo_e2e_ms / 1000)
    measurer = ProfileMeasurer(
        args.pod, args.model, args.deployment, outputs=[int(x) for x in args.outputs.split(",")],
        inputs=[int(x) for x in args.inputs.split(",")], rates=[float(x) for x in args.rates.split(",")],
        seconds_per_rate=args.seconds, slos=slos,
    )
    profile = await measurer.measure()
    out = Path(args.out or f"profiles/profile_{args.model}_{args.deployment}.json")
    await asyncio.to_thread(write_file, out, msgspec.json.format(msgspec.json.encode(profile)))
    print(f"wrote {out}")
    if args.redis:
        return await load([str(out)], args.redis, args.model)
    return 0


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def run(args: argparse.Namespace) -> int:
    if args.profiles_command == "load":
        return asyncio.run(load(args.files, args.redis, args.model))
    if args.profiles_command == "show":
        return asyncio.run(show(args.redis))
    return asyncio.run(measure(args))
