"""Agents as they are: the session signals Claude Code, Codex and Qwen Code send, through the official SDKs,
become the gateway's contexts (counted in flight, held on their pod, pinned to it), one per session, with a
Claude Code sub-agent its own."""

from __future__ import annotations

import anthropic
import openai

from tests.integration.test_kv_routing import MODEL, fleet, synced, system_prompt


async def test_claude_code_sessions_and_sub_agents_through_the_anthropic_sdk(start_mock_pod, start_gateway):
    pods, gw = await fleet(start_mock_pod, start_gateway, n=2)
    sdk = anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)
    working_set = gw.kits.kv.working_set
    served: dict[str, set[str]] = {}
    for turn in range(3):
        for who, headers in {
            "parent": {"X-Claude-Code-Session-Id": "9f0c-session"},
            "sub-agent": {"X-Claude-Code-Session-Id": "9f0c-session", "X-Claude-Code-Agent-Id": "explore-1"},
            "other": {"X-Claude-Code-Session-Id": "9f0c-session-2"},  # another session, not a prefix match
        }.items():
            raw = await sdk.messages.with_raw_response.create(
                model=MODEL, max_tokens=3, system=system_prompt(1 if who != "sub-agent" else 2),
                messages=[{"role": "user", "content": f"{who} turn {turn}"}], extra_headers=headers)
            served.setdefault(who, set()).add(raw.headers["x-gateway-pod"])
            await synced(gw, pods)
    keys = {"session:9f0c-session", "session:9f0c-session/agent:explore-1", "session:9f0c-session-2"}
    assert all(working_set.context(k) is not None and working_set.context(k).keyed for k in keys)
    assert all(len(pods_of) == 1 for pods_of in served.values())  # each session kept to its pod
    assert working_set.context("session:9f0c-session").stages == 3  # three turns, not nine
    # Without the header, Anthropic's metadata.user_id (where Claude Code puts its session) names it.
    await sdk.messages.create(model=MODEL, max_tokens=2, metadata={"user_id": "user_1_account_2_session_3"},
                              messages=[{"role": "user", "content": "hello"}])
    assert working_set.context("session:user_1_account_2_session_3") is not None


async def test_codex_and_qwen_code_sessions_through_the_openai_sdk(start_mock_pod, start_gateway):
    pods, gw = await fleet(start_mock_pod, start_gateway, n=2)
    sdk = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    working_set = gw.kits.kv.working_set
    for turn in range(2):
        # Codex sends its conversation in two headers and in prompt_cache_key: one context, not three.
        await sdk.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"codex turn {turn}"}],
            prompt_cache_key="0199-conv", extra_headers={"session_id": "0199-conv", "conversation_id": "0199-conv"})
        await sdk.chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"qwen turn {turn}"}],
            extra_headers={"X-Qwen-Code-Session-Id": "qwen-7"})
        await synced(gw, pods)
    assert working_set.context("session:0199-conv").stages == 2
    assert working_set.context("session:qwen-7").stages == 2
    assert working_set.size == 2
