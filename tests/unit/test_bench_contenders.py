"""What the bench's gateway contenders configure: the environment the runner starts each gateway with, read
back through the gateway's own config loader (a misspelt variable fails here, not silently in a benchmark)."""

from __future__ import annotations

import pytest

from bench.runner import CONTENDERS, BenchRunner
from gateway.config import GatewayConfig, PodConfig
from gateway.config.loading import load_config


def gateway_config(name: str) -> tuple[BenchRunner, GatewayConfig]:
    """The config the runner's gateway for contender ``name`` would load."""
    runner = BenchRunner(pods=1, num_blocks=10, speed=0.0, progress=False)
    contender = CONTENDERS[name]
    env = dict(contender.env)
    runner._gateway_command(contender, [PodConfig(url="http://127.0.0.1:9", name="mock-0")], 9, env)
    return runner, load_config(environ=env)


def test_kv_aware_tokenizes_with_the_bench_tokenizer():
    runner, config = gateway_config("gateway-kv_aware")
    assert runner.tokenizer is not None
    assert config.tokenization.models[runner.model].path == runner.tokenizer
    assert config.tokenization.default_mode == "remote"


def test_the_by_text_contender_has_no_tokenizer_at_all():
    # Neither the bench's local tokenizer nor a pod's /tokenize: kv_aware falls back to routing by text.
    runner, config = gateway_config("gateway-kv_aware-by-text")
    assert runner.tokenizer is not None  # the runner offered one; the contender's own choice won
    assert config.tokenization.models == {}
    assert config.tokenization.default_mode == "none"
    assert CONTENDERS["gateway-kv_aware-by-text"].policy == "kv_aware"


@pytest.mark.parametrize("name", ["gateway-kv_aware-no-workflow", "gateway-kv_aware-no-keep-warm"])
def test_other_contenders_keep_the_bench_tokenizer(name):
    runner, config = gateway_config(name)
    assert config.tokenization.models[runner.model].path == runner.tokenizer
